"""Reliability under a real tritonserver: every request ends in a correct answer or a clear
error, with no leaked KV blocks, no stuck requests and no crash, under malformed input, overload,
cancellation storms, an engine fault and a killed Python-backend stub.

All scenarios share one server (tests/e2e/conftest.py: `reliability_server`, models llm, llm_small,
embedding, rerank). Each prints its counts; the stub-kill scenario runs last.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient

from tests.e2e.malformed_requests import CASES, send
from tests.e2e.reliability_helpers import (
    GREEDY,
    PROMPTS,
    BackgroundTraffic,
    Outcome,
    check_llm,
    child_processes,
    compute_reference,
    grpc_request,
    http_generate_request,
    http_stream_request,
    metric,
    rss_mb,
    stub_pid,
    wait_engine_idle,
)
from tests.e2e.reliability_repository import FAULT_MARKER, SMALL_LLM

pytestmark = pytest.mark.e2e

MEMORY_GROWTH_LIMIT_MB = 300.0


def assert_idle(server, model: str) -> None:
    gauges = wait_engine_idle(server, model)
    assert not any(gauges.values()), f"{model} engine not idle: {gauges}"


def print_counts(title: str, counts: Counter, sent: int) -> None:
    kinds = ("completed", "refused", "errored", "cancelled", "stuck")
    print(f"\n[{title}] sent={sent} " + " ".join(f"{k}={counts.get(k, 0)}" for k in kinds))


# --- 1. malformed input ----------------------------------------------------------------------


def test_malformed_requests_get_clear_errors_while_good_traffic_flows(reliability_server):
    server = reliability_server
    reference = compute_reference(server, ("llm",))
    traffic = BackgroundTraffic(server, reference, ("llm",)).start()
    traffic.wait_rounds(1)
    rounds_at_start = traffic.rounds
    results = []
    try:
        for case in CASES:
            message = send(case, server.http_url, server.grpc_url)
            results.append((case, message, message is not None and case.expected in message))
        traffic.wait_rounds(rounds_at_start + 1)  # good traffic ran while the table was sent
    finally:
        traffic.stop()

    print(f"\n{'case':44} {'proto':5} {'model':10} result")
    for case, message, ok in results:
        print(
            f"{case.id:44} {case.protocol:5} {case.model:10} "
            f"{'errored-as-expected' if ok else 'WRONG: ' + repr(message)[:150]}"
        )
    matched = sum(ok for _, _, ok in results)
    protocols = Counter(case.protocol for case in CASES)
    print(
        f"[bad input] sent={len(CASES)} errored-as-expected={matched} ({dict(protocols)}); "
        f"good traffic: {traffic.requests} requests in {traffic.rounds} rounds, "
        f"problems={len(traffic.problems)}"
    )

    assert len(CASES) >= 40 and len({case.id for case in CASES}) == len(CASES)
    assert {"llm", "embedding", "rerank"} <= {case.model for case in CASES}
    assert [(case.id, message) for case, message, ok in results if not ok] == []
    assert traffic.rounds > rounds_at_start and traffic.problems == []
    assert_idle(server, "llm")


# --- 2. overload -----------------------------------------------------------------------------

OVERLOAD_PARAMS = {"temperature": 0, "max_tokens": 100, "ignore_eos": True}
OVERLOAD_CLIENTS = 8 * int(SMALL_LLM["max_num_seqs"])
OVERLOAD_WAVES = 3


def overload_request(server, index: int) -> tuple[str, Outcome]:
    prompt = PROMPTS[index % len(PROMPTS)]
    send_request = http_stream_request if index % 4 == 3 else grpc_request
    url = server.http_url if send_request is http_stream_request else server.grpc_url
    return prompt, send_request(url, "llm_small", prompt, OVERLOAD_PARAMS)


def test_overload_each_request_completes_correctly_or_is_refused(reliability_server):
    server = reliability_server
    model = "llm_small"
    alone = {}
    for prompt in PROMPTS:  # sequentially, on the same server: the outputs to match
        outcome = grpc_request(server.grpc_url, model, prompt, OVERLOAD_PARAMS)
        assert outcome.kind == "completed", outcome
        alone[prompt] = outcome.text
    memory_before = rss_mb(server)
    preemptions_before = metric(server, "vllm:num_preemptions_total", model)
    peaks = {"running": 0.0, "waiting": 0.0}
    done = threading.Event()

    def watch_gauges() -> None:
        while not done.is_set():
            peaks["running"] = max(
                peaks["running"], metric(server, "vllm:num_requests_running", model)
            )
            peaks["waiting"] = max(
                peaks["waiting"], metric(server, "vllm:num_requests_waiting", model)
            )
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_gauges, daemon=True)
    watcher.start()
    outcomes: list[tuple[str, Outcome]] = []
    try:
        for _ in range(OVERLOAD_WAVES):
            with ThreadPoolExecutor(OVERLOAD_CLIENTS) as pool:
                outcomes += pool.map(lambda i: overload_request(server, i), range(OVERLOAD_CLIENTS))
    finally:
        done.set()
        watcher.join()
    assert_idle(server, model)
    memory_after = rss_mb(server)

    counts = Counter(outcome.kind for _, outcome in outcomes)
    print_counts("overload", counts, len(outcomes))
    growth = sum(memory_after.values()) - sum(memory_before.values())
    print(
        f"[overload] preemptions={metric(server, 'vllm:num_preemptions_total', model) - preemptions_before:.0f} "
        f"peak running={peaks['running']:.0f} peak waiting={peaks['waiting']:.0f}"
    )
    print(
        "[overload] RSS MB before -> after: "
        + ", ".join(
            f"{name} {memory_before.get(name, 0):.0f} -> {memory_after.get(name, 0):.0f}"
            for name in memory_after
        )
        + f"; total growth {growth:+.1f} MB"
    )

    wrong = [
        (prompt, outcome)
        for prompt, outcome in outcomes
        if not (outcome.kind == "completed" and outcome.text == alone[prompt])
        and not (outcome.kind == "refused" and "max_queue_size=8" in outcome.error)
    ]
    assert wrong == []
    assert counts["completed"] > 0 and counts["refused"] > 0  # both paths really taken
    assert peaks["running"] <= int(SMALL_LLM["max_num_seqs"])
    # Waiting holds the admitted queue plus running sequences preempted back into it.
    assert peaks["waiting"] <= int(SMALL_LLM["max_queue_size"]) + int(SMALL_LLM["max_num_seqs"])
    assert growth < MEMORY_GROWTH_LIMIT_MB


# --- 3. cancellation storm -------------------------------------------------------------------

STORM_REQUESTS = 240
STORM_CLIENTS = 32
STORM_PARAMS = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}


def test_cancellation_storm_leaves_the_engine_idle_and_serving(reliability_server):
    server = reliability_server
    expected = {p: grpc_request(server.grpc_url, "llm", p, STORM_PARAMS).text for p in PROMPTS}
    rng = random.Random(7)
    # (prompt, over HTTP?, cancel after this many responses or None); a random half is cancelled.
    cancelled = set(rng.sample(range(STORM_REQUESTS), STORM_REQUESTS // 2))
    plan = [
        (rng.choice(PROMPTS), i % 3 == 0, rng.randint(0, 8) if i in cancelled else None)
        for i in range(STORM_REQUESTS)
    ]
    aborts_before = metric(server, "vllm:request_success_total", "llm", finished_reason="abort")

    def run(item: tuple[str, bool, int | None]) -> Outcome:
        prompt, over_http, cancel_after = item
        if over_http:
            return http_stream_request(server.http_url, "llm", prompt, STORM_PARAMS, cancel_after)
        return grpc_request(server.grpc_url, "llm", prompt, STORM_PARAMS, cancel_after)

    with ThreadPoolExecutor(STORM_CLIENTS) as pool:
        outcomes = list(pool.map(run, plan))
    gauges = wait_engine_idle(server, "llm")
    aborts = (
        metric(server, "vllm:request_success_total", "llm", finished_reason="abort") - aborts_before
    )

    counts = Counter(outcome.kind for outcome in outcomes)
    print_counts("cancellation storm", counts, len(outcomes))
    print(
        f"[cancellation storm] over HTTP={sum(p[1] for p in plan)} engine aborts={aborts:.0f} "
        f"gauges after={gauges}"
    )
    for index, ((prompt, _, _), outcome) in enumerate(zip(plan, outcomes, strict=True)):
        if outcome.kind == "completed":  # (a planned cancel may come late: responses merge)
            assert outcome.text == expected[prompt]
        else:  # what a cancelled stream received so far is the start of the same answer
            assert outcome.kind == "cancelled" and index in cancelled, outcome
            assert expected[prompt].startswith(outcome.text)
    assert counts["cancelled"] > 0
    assert not any(gauges.values()), gauges
    assert aborts > 0
    assert (
        grpc_request(server.grpc_url, "llm", PROMPTS[0], STORM_PARAMS).text == expected[PROMPTS[0]]
    )


# --- 4a. an engine fault ---------------------------------------------------------------------


def test_injected_engine_fault_fails_only_that_request(reliability_server):
    server = reliability_server
    reference = compute_reference(server, ("llm",))
    errors_before = metric(server, "vllm:request_success_total", "llm", finished_reason="error")
    # 12 good requests and 4 carrying the marker, interleaved so they share engine steps.
    plan = [
        (PROMPTS[i % len(PROMPTS)] + (f" {FAULT_MARKER}" if i % 4 == 1 else ""), i % 2 == 0)
        for i in range(16)
    ]

    def run(item: tuple[str, bool]) -> Outcome:
        prompt, over_http = item
        if over_http:
            return http_generate_request(server.http_url, "llm", prompt, GREEDY)
        return grpc_request(server.grpc_url, "llm", prompt, GREEDY)

    with ThreadPoolExecutor(len(plan)) as pool:
        outcomes = list(pool.map(run, plan))
    assert_idle(server, "llm")
    errors = (
        metric(server, "vllm:request_success_total", "llm", finished_reason="error") - errors_before
    )

    counts = Counter(outcome.kind for outcome in outcomes)
    print_counts("engine fault", counts, len(outcomes))
    faulty = [(p, o) for p, o in zip(plan, outcomes, strict=True) if FAULT_MARKER in p[0]]
    good = [(p, o) for p, o in zip(plan, outcomes, strict=True) if FAULT_MARKER not in p[0]]
    assert len(faulty) == 4 and all(
        o.kind == "errored" and "injected fault" in o.error for _, o in faulty
    ), faulty
    assert all(o.kind == "completed" and o.text == reference.texts["llm"][p] for (p, _), o in good)
    assert errors == len(faulty)
    assert check_llm(server, reference, "llm", PROMPTS[1]) is None


# --- 4b. a killed stub (last: it reloads the llm model) --------------------------------------


def wait_exited(pid: int, parent: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while pid in child_processes(parent) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid not in child_processes(parent)


def test_killed_llm_stub_is_reported_and_an_explicit_reload_brings_it_back(reliability_server):
    """What Triton 2.51 does when the llm's Python stub dies (SIGKILL): every later request to the
    model fails at once with "Stub process 'llm_0_0' is not healthy." (gRPC and HTTP), while model
    and server readiness still say READY and no stub is restarted. Unloading and loading the model
    (explicit model control; a bare `load` of an unchanged model may be a no-op) starts a new stub
    in the same tritonserver; the other models serve throughout."""
    server = reliability_server
    client = httpclient.InferenceServerClient(server.http_url)
    reference = compute_reference(server, ("llm", "llm_small"))
    server_pid, old_stub = server.process.pid, stub_pid(server, "llm")
    others = BackgroundTraffic(server, reference, ("llm_small",)).start()
    others.wait_rounds(1)
    try:
        os.kill(old_stub, signal.SIGKILL)
        wait_exited(old_stub, server_pid)
        after_kill = [
            grpc_request(server.grpc_url, "llm", PROMPTS[0], GREEDY),
            http_generate_request(server.http_url, "llm", PROMPTS[0], GREEDY),
        ]
        ready_after_kill = client.is_model_ready("llm"), client.is_server_ready()
        with pytest.raises(LookupError):
            stub_pid(server, "llm")  # not restarted by Triton
        client.unload_model("llm")
        client.load_model("llm")
        new_stub = stub_pid(server, "llm")
        reloaded = check_llm(server, reference, "llm", PROMPTS[0])
        others.wait_rounds(others.rounds + 1)
    finally:
        others.stop()
        client.close()

    print(
        f"\n[stub kill] after SIGKILL: {[(o.kind, o.error) for o in after_kill]}; "
        f"model/server ready={ready_after_kill}; stub {old_stub} -> {new_stub} under tritonserver "
        f"{server_pid}; other models: {others.requests} requests, problems={len(others.problems)}"
    )
    for outcome in after_kill:
        assert (
            outcome.kind == "errored" and "Stub process 'llm_0_0' is not healthy" in outcome.error
        )
    assert ready_after_kill == (True, True)  # Triton 2.51: readiness does not notice a dead stub
    assert new_stub != old_stub and server.process.pid == server_pid and server.is_alive()
    assert reloaded is None, reloaded
    assert others.problems == []
    assert_idle(server, "llm")
