"""End to end: the architectures beyond the Llama family (tiny random mixtures of experts, Gemma 2
and 3, Phi-3; each a version of `llm`) served by a real tritonserver give the greedy tokens of
transformers' `generate`, a prompt longer than the Gemma checkpoints' sliding window included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.llm_client import http_generate
from tests.e2e.llm_helpers import write_versioned_llm
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.e2e

NEW_FAMILIES = (
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
ARCHS = {str(version): arch for version, arch in enumerate(NEW_FAMILIES, start=1)}
NUM_TOKENS = 8


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    checkpoints = {version: engine_checkpoint(arch)[0] for version, arch in ARCHS.items()}
    # As make_engine: within Phi-3's original context, LongRoPE's short factors (those
    # transformers applies to these short sequences).
    return write_versioned_llm(tmp_path, checkpoints, max_model_len="128")


def test_each_architecture_serves_transformers_greedy_tokens(repository, make_server):
    server = make_server(repository)
    params = json.dumps({"temperature": 0, "max_tokens": NUM_TOKENS, "ignore_eos": True})
    for version, arch in ARCHS.items():
        model_dir, hf = engine_checkpoint(arch)
        engine = make_engine(model_dir)
        for seed, length in ((1, 5), (2, 19)):
            prompt = random_prompt(length, seed)
            (direct,) = engine.generate([prompt], greedy(NUM_TOKENS))
            assert direct.outputs[0].token_ids == hf_greedy(hf, prompt, NUM_TOKENS)
            body = {
                "text_input": "",
                "prompt_token_ids": prompt,
                "sampling_parameters": params,
                "exclude_input_in_output": True,
            }
            served = http_generate(server.http_url, body, version=version)
            assert served["text_output"] == direct.outputs[0].text, (version, arch)
