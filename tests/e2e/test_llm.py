"""End to end: the llm model under a real tritonserver (with embedding and rerank loaded beside it)."""

from __future__ import annotations

import json
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import grpc_stream, http_error_text, http_generate, http_generate_stream
from tests.e2e.llm_helpers import GREEDY, LABELS, assert_engine_idle, direct_text, metric
from tooling.repository import REPO_ROOT

pytestmark = pytest.mark.e2e

PROMPTS = ["ROMEO:", "To be, or not to be,", "KING HENRY:\nNow, lords,"]


def test_greedy_output_is_the_same_over_grpc_stream_http_and_direct(server, direct_engine):
    for prompt in PROMPTS:
        expected = direct_text(direct_engine, prompt)
        streamed = grpc_stream(server.grpc_url, prompt, GREEDY)
        assert streamed.error is None, streamed.error
        assert streamed.text == expected
        assert len(streamed.pieces) > 1  # really streamed, one response per step
        body = {
            "text_input": prompt,
            "sampling_parameters": json.dumps(GREEDY),
            "exclude_input_in_output": True,
        }
        assert http_generate(server.http_url, body)["text_output"] == expected
        events = http_generate_stream(server.http_url, {**body, "stream": True})
        assert "".join(e["text_output"] for e in events) == expected


def test_non_streaming_prepends_prompt_by_default_and_scalar_inputs_work(server, direct_engine):
    expected = direct_text(direct_engine, "ROMEO:", max_tokens=20)
    result = http_generate(
        server.http_url, {"text_input": "ROMEO:", "max_tokens": 20, "temperature": 0.0}
    )
    assert result["text_output"] == "ROMEO:" + expected


def test_vllm_backend_client_payload_works_unchanged(server):
    params = {"max_tokens": "12", "temperature": "0", "ignore_eos": "true", "logprobs": "2"}
    flags = (
        "return_finish_reason",
        "return_cumulative_logprob",
        "return_logprobs",
        "return_num_input_tokens",
        "return_num_output_tokens",
    )
    result = grpc_stream(server.grpc_url, "ROMEO:", params, flags=flags)
    assert result.error is None, result.error
    last = result.responses[-1]
    assert last["finish_reason"].tolist() == [b"length"]
    assert sum(int(r["num_output_tokens"][0]) for r in result.responses) == 12
    assert int(last["num_input_tokens"][0]) > 0
    logprobs = [json.loads(r["logprobs"][0]) for r in result.responses]
    positions = [p for chunk in logprobs for p in chunk]
    assert len(positions) == 12
    assert all(2 <= len(p) <= 3 for p in positions)
    for position in positions:  # greedy: the sampled token is the top one, rank 1
        best = max(position.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1 and isinstance(best["decoded_token"], str)
        assert sorted(v["rank"] for v in position.values())[:2] == [1, 2]
    total = sum(max(v["logprob"] for v in p.values()) for p in positions)  # greedy: the top token
    assert float(last["cumulative_logprob"][0]) == pytest.approx(total, abs=1e-3)


def test_concurrent_streams_metrics_and_prefix_cache(server, direct_engine):
    shared = "FIRST CITIZEN:\nBefore we proceed any further, hear me speak.\n" * 4
    prompts = [shared + f"SECOND CITIZEN {i}:" for i in range(32)]
    # 96 tokens each: the burst must outlast several scrapes (~50 ms each) on a fast engine,
    # else the gauges are sampled only before and after it (seen: 16 tokens, 0.4 s in all).
    params = {**GREEDY, "max_tokens": 96, "ignore_eos": True}
    expected = {p: direct_text(direct_engine, p, **params) for p in prompts[:4]}
    hits_before = metric(server, "vllm:prefix_cache_hits_total")
    observed = {"running": 0.0, "kv": 0.0}

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done:
            samples = parse_prometheus_text(server.metrics_text())
            for key, name in (
                ("running", "vllm:num_requests_running"),
                ("kv", "vllm:kv_cache_usage_perc"),
            ):
                observed[key] = max(observed[key], samples.get((name, LABELS), 0.0))
            time.sleep(0.02)

    done = False
    with ThreadPoolExecutor(33) as pool:
        watcher = pool.submit(watch)
        results = list(pool.map(lambda p: grpc_stream(server.grpc_url, p, params), prompts))
        done = True
        watcher.result()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None, result.error
        if prompt in expected:
            assert result.text == expected[prompt]
    assert observed["running"] > 1 and observed["kv"] > 0
    assert metric(server, "vllm:prefix_cache_hits_total") > hits_before
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:request_success_total", finished_reason="length") >= 32


def test_cancel_mid_stream_frees_blocks(server):
    result = grpc_stream(
        server.grpc_url,
        "ROMEO:",
        {"max_tokens": 400, "ignore_eos": True, "temperature": 0},
        cancel_after=3,
    )
    assert len(result.responses) == 3
    assert_engine_idle(server)
    assert grpc_stream(server.grpc_url, "JULIET:", GREEDY).error is None


@pytest.mark.parametrize(
    "body,fragment",
    [
        ({"text_input": "hi", "sampling_parameters": "{not json"}, "not valid JSON"),
        (
            {"text_input": "hi", "sampling_parameters": '{"colour": "red"}'},
            "unknown sampling parameter 'colour'",
        ),
        (
            {"text_input": "hi", "sampling_parameters": '{"temperature": -2}'},
            "temperature must be >= 0",
        ),
        ({"text_input": "hi", "sampling_parameters": '{"top_p": 7}'}, "top_p must be in (0, 1]"),
        ({"text_input": "word " * 5000}, "max_model_len"),
        ({"text_input": ""}, "empty"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"text_input": "hi", "max_tokens": 10**9}, "max_tokens"),
    ],
)
def test_bad_input_gets_clear_error_while_others_carry_on(server, body, fragment):
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(grpc_stream, server.grpc_url, "ROMEO:", GREEDY)
        with pytest.raises(urllib.error.HTTPError) as info:
            http_generate(server.http_url, body)
        assert fragment in http_error_text(info.value)
        assert good.result().error is None


def test_cli_client_streams_the_completion(server, direct_engine):
    import subprocess
    import sys

    expected = direct_text(direct_engine, "JULIET:", max_tokens=12)
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "client.py"),
            "JULIET:",
            "--url",
            server.grpc_url,
            "--temperature",
            "0",
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert completed.stdout == "JULIET:" + expected + "\n"


def test_http_stream_disconnect_frees_blocks(server):
    import http.client

    aborted_before = metric(server, "vllm:request_success_total", finished_reason="abort")
    connection = http.client.HTTPConnection(*server.http_url.split(":"), timeout=60)
    body = json.dumps(
        {
            "text_input": "ROMEO:",
            "stream": True,
            "sampling_parameters": json.dumps(
                {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
            ),
        }
    )
    connection.request(
        "POST", "/v2/models/llm/generate_stream", body, {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.readline().startswith(b"data:")  # streaming has begun
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    assert_engine_idle(server)
    assert metric(server, "vllm:request_success_total", finished_reason="abort") > aborted_before
