"""End to end: pre-quantized compressed-tensors checkpoints of the Shakespeare model (W4A16 group
128 and W8A16, versions 2 and 3 of `llm`) served by a real tritonserver beside the float one
(version 1): with chunked prefill (16-token steps) and prefix-cache hits, streamed over gRPC and
not over HTTP, each version's greedy text is the engine's, whose tokens are transformers' on the
same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.llm_client import grpc_stream, http_generate
from tests.e2e.llm_helpers import write_versioned_llm
from tests.llm.engine_helpers import greedy, make_engine
from tests.llm.quantized_checkpoint_helpers import quantized_shakespeare
from tests.llm.shakespeare_helpers import HELD_OUT, SHAKESPEARE
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

CHECKPOINTS = {"2": "W4A16_G128", "3": "W8A16_CHANNEL"}
NUM_TOKENS = 12
SHARED = HELD_OUT["Sonnet 154"][:160]
PROMPTS = (SHARED + " Love", SHARED + " fire")
"""Two prompts sharing ~40 tokens: the second request of each version hits the prefix cache."""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    checkpoints = {"1": SHAKESPEARE}
    checkpoints.update({v: quantized_shakespeare(p) for v, p in CHECKPOINTS.items()})
    return write_versioned_llm(
        tmp_path, checkpoints, max_model_len="256", max_num_batched_tokens="16"
    )


def engine_text(checkpoint: Path, prompt: str) -> str:
    """The engine's greedy text, after checking its tokens are transformers' on the checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoint)(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    (out,) = make_engine(checkpoint, max_model_len=256).generate([ids], greedy(NUM_TOKENS))
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, NUM_TOKENS)
    return out.outputs[0].text


def test_quantized_versions_serve_transformers_greedy_text(repository, make_server):
    server = make_server(repository)
    params = {"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    for version, preset in CHECKPOINTS.items():
        for prompt in PROMPTS:
            expected = engine_text(quantized_shakespeare(preset), prompt)
            body = {
                "text_input": prompt,
                "sampling_parameters": json.dumps(params),
                "exclude_input_in_output": True,
            }
            assert http_generate(server.http_url, body, version=version)["text_output"] == expected
            streamed = grpc_stream(server.grpc_url, prompt, params, model_version=version)
            assert streamed.error is None and "".join(streamed.pieces) == expected
    # The float version serves beside them.
    body = {
        "text_input": PROMPTS[0],
        "sampling_parameters": json.dumps(params),
        "exclude_input_in_output": True,
    }
    assert http_generate(server.http_url, body, version="1")["text_output"]
