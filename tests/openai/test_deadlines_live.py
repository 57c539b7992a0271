"""Deadlines end to end, on the session's tritonserver and frontend: a long generation given a
short deadline ends with deadline_exceeded, in each client's own shape: tritonclient's gRPC
stream with Triton's request `timeout` (microseconds), HTTP `/generate` with `deadline_ms`, the
`openai` and `anthropic` SDKs with `x-request-timeout` (a 504). Each ends within a second of its
deadline, a request beside it gets its whole answer, and the engine is left with nothing running
and no KV block in use."""

from __future__ import annotations

import json
import queue
import time
import urllib.error

import anthropic
import openai
import pytest
import tritonclient.grpc as grpcclient

from backend_lib.contract import ErrorCode, decode_error
from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import http_error_text, http_generate, llm_inputs

pytestmark = pytest.mark.e2e

LONG = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
"""Seconds of decoding on CPU: far past the deadlines below."""
MESSAGES = [{"role": "user", "content": "Who goes there?"}]


def engine_idle(server) -> None:
    """Nothing running and no KV block in use on the llm, within a few seconds."""
    deadline = time.monotonic() + 10
    while True:
        scraped = parse_prometheus_text(server.metrics_text())
        values = {
            name: value
            for (name, labels), value in scraped.items()
            if dict(labels).get("model") == "llm"
            and name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
        }
        if values and not any(values.values()) or time.monotonic() > deadline:
            assert values and not any(values.values()), values
            return
        time.sleep(0.2)


def test_triton_request_timeout_over_a_grpc_stream(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        started = time.monotonic()
        client.async_stream_infer("llm", llm_inputs("ROMEO:", LONG), timeout=300_000)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                break
        ended = time.monotonic()
    finally:
        client.stop_stream()
        client.close()
    code, message = decode_error(str(error.message()))
    assert code is ErrorCode.DEADLINE_EXCEEDED, error
    assert "deadline of 300 ms" in message and ended - started < 1.3
    engine_idle(server)


def test_deadline_ms_over_http_generate_and_the_request_beside_it(server):
    beside = {
        "text_input": "JULIET:",
        "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 12}),
    }
    late = {"text_input": "ROMEO:", "sampling_parameters": json.dumps({**LONG, "deadline_ms": 250})}
    with pytest.raises(urllib.error.HTTPError) as error:
        http_generate(server.http_url, late)
    code, message = decode_error(json.loads(http_error_text(error.value))["error"])
    assert code is ErrorCode.DEADLINE_EXCEEDED and "while running" in message
    assert http_generate(server.http_url, beside)["text_output"]
    engine_idle(server)


def test_x_request_timeout_through_the_openai_and_anthropic_sdks(server, frontend):
    sdk = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as error:
        sdk.chat.completions.create(
            model="llm",
            messages=MESSAGES,
            max_tokens=900,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-timeout": "0.4"},
        )
    assert error.value.status_code == 504 and error.value.body["type"] == "timeout_error"
    assert "deadline of 400 ms" in error.value.body["message"]
    assert time.monotonic() - started < 2.0
    # 1 ms: past before the first step, whatever the answer's length (Messages has no ignore_eos).
    claude = anthropic.Anthropic(base_url=frontend.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as error:
        claude.messages.create(
            model="llm",
            messages=MESSAGES,
            max_tokens=900,
            extra_headers={"x-request-timeout": "0.001"},
        )
    assert error.value.status_code == 504
    assert error.value.body["error"]["type"] == "timeout_error"
    answer = sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].message.content
    engine_idle(server)
