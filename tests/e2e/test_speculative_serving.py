"""End to end: llms with speculative decoding (`speculative_config` in their config.pbtxt: n-gram
prompt lookup, and the shipped draft model found relative to the model's directory) served by a
real tritonserver beside the same checkpoint without it: the same greedy text over HTTP generate
and gRPC streaming (a streamed response may carry several tokens), vLLM's spec-decode counters
on the metrics port, and a bad speculative_config or a draft model with another tokenizer fails
that model's load only, naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import grpc_stream, http_generate
from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.shakespeare_helpers import HELD_OUT, SHAKESPEARE, SHAKESPEARE_DRAFT
from tooling.repository import ModelSpec, write_model
from tooling.tritonserver import http_status

pytestmark = pytest.mark.e2e

SONNET = HELD_OUT["Sonnet 154"]
PROMPTS = (SONNET + "\n" + SONNET[:60], "ROMEO:\nWhat light")
PARAMS = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
DRAFT = {
    "method": "draft_model",
    "model": "../drafts/shakespeare-draft",
    "num_speculative_tokens": 3,
}
"""The draft's path is relative to the model's directory, as `model` is."""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    drafts = tmp_path / "drafts"  # outside the repository's model directories
    shutil.copytree(SHAKESPEARE_DRAFT, drafts / "shakespeare-draft")
    other, _ = engine_checkpoint("LlamaForCausalLM")  # its own tokenizer and vocabulary
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    for name, speculative in (
        ("llm", None),
        ("llm_spec", NGRAM),
        ("llm_draft", DRAFT),
        ("llm_bad_spec", {**NGRAM, "method": "medusa"}),
        ("llm_bad_draft", {**DRAFT, "model": str(other)}),
    ):
        extra = {} if speculative is None else {"speculative_config": json.dumps(speculative)}
        write_model(ModelSpec(name, "llm", {**common, **extra}, max_batch_size=0), tmp_path)
    return tmp_path


def _body(prompt: str) -> dict:
    return {
        "text_input": prompt,
        "sampling_parameters": json.dumps(PARAMS),
        "exclude_input_in_output": True,
    }


def test_a_speculating_llm_serves_the_plain_text_and_counts_its_drafts(repository, make_server):
    server = make_server(repository, extra_args=("--exit-on-error=false",))
    for bad in ("llm_bad_spec", "llm_bad_draft"):
        assert http_status(f"http://{server.http_url}/v2/models/{bad}/ready") != 200
    log = server.log_text()
    assert "speculative_config.method" in log
    assert "speculative_config.model" in log and "the target's tokenizer" in log
    responses = {"llm_spec": [], "llm_draft": []}
    for prompt in PROMPTS:
        expected = http_generate(server.http_url, _body(prompt), model="llm")["text_output"]
        for model, pieces in responses.items():
            got = http_generate(server.http_url, _body(prompt), model=model)["text_output"]
            assert got == expected, model
            streamed = grpc_stream(server.grpc_url, prompt, PARAMS, model=model)
            assert streamed.error is None and streamed.text == expected, model
            pieces.append(len(streamed.pieces))
    # Fewer responses than tokens: a step's accepted drafts arrive together (n-gram: on the
    # quoting prompt).
    assert responses["llm_spec"][0] < PARAMS["max_tokens"]
    assert all(n < PARAMS["max_tokens"] for n in responses["llm_draft"])

    samples = parse_prometheus_text(server.metrics_text())

    def counter(name: str, model: str, **labels: str) -> float:
        wanted = {"model": model, "version": "1", "model_name": model, **labels}
        return samples.get((name, frozenset(wanted.items())), -1.0)

    drafts = counter("vllm:spec_decode_num_drafts_total", "llm_spec")
    draft_tokens = counter("vllm:spec_decode_num_draft_tokens_total", "llm_spec")
    accepted = counter("vllm:spec_decode_num_accepted_tokens_total", "llm_spec")
    first = counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "llm_spec", position="0")
    assert drafts > 0 and 0 < accepted <= draft_tokens and 0 < first <= drafts
    assert counter("vllm:spec_decode_num_accepted_tokens_total", "llm_draft") > 0
    assert counter("vllm:spec_decode_num_drafts_total", "llm") == -1.0  # not speculating: none
