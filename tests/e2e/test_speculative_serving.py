"""End to end: an llm with n-gram speculative decoding (`speculative_config` in its config.pbtxt)
served by a real tritonserver beside the same checkpoint without it: the same greedy text over
HTTP generate and gRPC streaming (a streamed response may carry several tokens), vLLM's
spec-decode counters on the metrics port, and a bad speculative_config fails that model's load
only, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import grpc_stream, http_generate
from tests.llm.shakespeare_helpers import HELD_OUT, SHAKESPEARE
from tooling.repository import ModelSpec, write_model
from tooling.tritonserver import http_status

pytestmark = pytest.mark.e2e

SONNET = HELD_OUT["Sonnet 154"]
PROMPTS = (SONNET + "\n" + SONNET[:60], "ROMEO:\nWhat light")
PARAMS = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    for name, extra in (
        ("llm", {}),
        ("llm_spec", {"speculative_config": json.dumps(NGRAM)}),
        ("llm_bad_spec", {"speculative_config": json.dumps({**NGRAM, "method": "medusa"})}),
    ):
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
    assert http_status(f"http://{server.http_url}/v2/models/llm_bad_spec/ready") != 200
    assert "speculative_config.method" in server.log_text()
    responses = []
    for prompt in PROMPTS:
        expected = http_generate(server.http_url, _body(prompt), model="llm")["text_output"]
        got = http_generate(server.http_url, _body(prompt), model="llm_spec")["text_output"]
        assert got == expected
        streamed = grpc_stream(server.grpc_url, prompt, PARAMS, model="llm_spec")
        assert streamed.error is None and streamed.text == expected
        responses.append(len(streamed.pieces))
    # Fewer responses than tokens: a step's accepted drafts arrive together (the quoting prompt).
    assert responses[0] < PARAMS["max_tokens"]

    samples = parse_prometheus_text(server.metrics_text())

    def counter(name: str, model: str, **labels: str) -> float:
        wanted = {"model": model, "version": "1", "model_name": model, **labels}
        return samples.get((name, frozenset(wanted.items())), -1.0)

    drafts = counter("vllm:spec_decode_num_drafts_total", "llm_spec")
    draft_tokens = counter("vllm:spec_decode_num_draft_tokens_total", "llm_spec")
    accepted = counter("vllm:spec_decode_num_accepted_tokens_total", "llm_spec")
    first = counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "llm_spec", position="0")
    assert drafts > 0 and 0 < accepted <= draft_tokens and 0 < first <= drafts
    assert counter("vllm:spec_decode_num_drafts_total", "llm") == -1.0  # not speculating: none
