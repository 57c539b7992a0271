"""Deadlines at the Triton seam (LLMService, as model.py drives it): Triton's request timeout and
the `deadline_ms` sampling parameter end a request with the response error model.py sends as
`pb_utils.TritonError` ([deadline_exceeded], code UNAVAILABLE); the earlier of the two counts; a
bad deadline_ms is refused at once; the engine loop wakes for a deadline while it would sleep;
failures are counted by reason; the other request's text is unchanged."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

from backend_lib.contract import ErrorCode, decode_error
from backend_lib.errors import DeadlineExceeded, InputError, response_error
from backend_lib.llm.serving.metrics import EXTRA_LABELS, FAILURE_REASONS
from backend_lib.llm.serving.service import LLMService
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text
from tests.llm.engine_helpers import assert_pool_released, engine_checkpoint
from tests.llm.service_helpers import (
    MAX_TOKENS,
    PROMPTS,
    expected_texts,
    inputs,
    service_from_context,
)
from tests.llm.structured.compile_helpers import STUCK_N, costly_schema

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def long_inputs(prompt: str, **fields) -> dict[str, np.ndarray]:
    params = {"temperature": 0, "max_tokens": 100, "ignore_eos": True, **fields}
    return {
        **inputs(prompt),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
    }


def short_inputs(prompt: str, **fields) -> dict[str, np.ndarray]:
    """`inputs(prompt)` (greedy, MAX_TOKENS tokens) with more sampling parameters."""
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **fields}
    return {
        **inputs(prompt),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
    }


def wait_until(condition, seconds: float) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def final(service: LLMService, job) -> tuple[str, Exception | None, float]:
    """(streamed text, error, when the last response came) of a submitted job."""
    text = ""
    for result, _final in service.responses(job):
        if isinstance(result, Exception):
            return text, result, time.monotonic()
        text += b"".join(result["text_output"]).decode()
    return text, None, time.monotonic()


@pytest.fixture
def service():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    service = service_from_context(model_dir, sink)
    service.sink = sink
    yield service
    service.shutdown()


def failures(service) -> dict[str, float]:
    scraped = parse_prometheus_text(generate_latest(service.sink.registry).decode())
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in scraped.items()
        if name == "llm_request_failures_total"
    }


@pytest.mark.parametrize("source", ["deadline_ms", "triton_timeout"])
def test_a_request_past_its_deadline_gets_deadline_exceeded_and_the_other_finishes(service, source):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    # 100 tokens take far longer than 30 ms: the deadline ends it a few steps in.
    if source == "deadline_ms":
        slow = service.submit(long_inputs("tor al", deadline_ms=30))
    else:
        slow = service.submit(long_inputs("tor al"), timeout_us=30_000)
    good = service.submit(inputs(PROMPTS[0]))
    started = time.monotonic()
    _, error, ended = final(service, slow)
    assert isinstance(error, DeadlineExceeded) and ended - started < 5.0
    code, message = response_error(error)
    assert code == "UNAVAILABLE"
    assert decode_error(message)[0] is ErrorCode.DEADLINE_EXCEEDED
    assert "deadline of 30 ms" in message
    assert final(service, good)[:2] == (expected_texts(model_dir)[0], None)
    assert failures(service) == dict.fromkeys(FAILURE_REASONS, 0) | {"deadline_exceeded": 1}
    assert_pool_released(service.engine)


def test_the_earlier_of_timeout_and_deadline_ms_counts(service):
    job = service.submit(long_inputs("tor al", deadline_ms=60_000), timeout_us=20_000)
    _, error, _ = final(service, job)
    assert isinstance(error, DeadlineExceeded) and "deadline of 20 ms" in str(error)


@pytest.mark.parametrize("bad", [-1, 0, "soon", float("inf"), 10**400])
def test_a_bad_deadline_ms_is_refused_at_once(service, bad):
    bad_json = "1e999" if bad == float("inf") else json.dumps(bad)
    params = '{"max_tokens": 4, "deadline_ms": ' + bad_json + "}"
    request = {**inputs("tor"), "sampling_parameters": np.array([params.encode()], dtype=object)}
    with pytest.raises(InputError, match="deadline_ms"):
        service.start(request, lambda result, final: None, lambda: False)
    assert failures(service)["invalid_input"] == 1


def test_a_request_held_for_its_grammar_ends_at_its_deadline(service):
    """The engine loop sleeps while its only request waits for a grammar compile; the deadline
    wakes it, and the held request ends then, long before its compile would finish."""
    costly = {"json": costly_schema(STUCK_N)}  # compiles for well over 10 s
    started = time.monotonic()
    job = service.submit(long_inputs("tor", structured_outputs=costly, deadline_ms=500))
    _, error, ended = final(service, job)
    assert isinstance(error, DeadlineExceeded), error
    assert "while waiting" in str(error) and 0.5 <= ended - started < 3.0
    assert_pool_released(service.engine)


def test_1000_requests_with_random_deadlines_each_end_in_full_or_in_time(service, monkeypatch):
    """1,000 requests through the service as model.py drives it, with deadlines from Triton's
    timeout or deadline_ms, some due on arrival, some never: each ends with its whole text or
    with deadline_exceeded no later than the longest engine-loop iteration (one step with its
    admissions) plus 50 ms after its due time; the pool is empty at the end."""
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    texts = dict(zip(PROMPTS, expected_texts(model_dir), strict=True))
    loop, iteration_seconds = service.loop, []
    real_iteration = loop._iteration

    def timed_iteration(*args):
        started = time.monotonic()
        try:
            real_iteration(*args)
        finally:
            iteration_seconds.append(time.monotonic() - started)

    monkeypatch.setattr(loop, "_iteration", timed_iteration)
    rng, ends = random.Random(0), {}
    due, prompts, received = {}, {}, {k: "" for k in range(1000)}

    def sender(k: int):
        def send(result, last: bool) -> None:
            if isinstance(result, Exception):
                received[k] = result
            else:
                received[k] += b"".join(result["text_output"]).decode()
            if last:
                ends[k] = time.monotonic()

        return send

    for k in range(1000):
        prompts[k] = rng.choice(PROMPTS)
        choice, fields, timeout_us = rng.random(), {}, 0
        if choice < 0.1:
            timeout_us = 1  # due on arrival
        elif choice < 0.45:
            fields["deadline_ms"] = rng.uniform(1, 2000)
        elif choice < 0.75:
            timeout_us = rng.randint(1_000, 2_000_000)
        limit = timeout_us / 1e6 if timeout_us else fields.get("deadline_ms", 0) / 1e3 or None
        submitted = time.monotonic()  # no later than the service's arrival time
        due[k] = None if limit is None else submitted + limit
        service.start(short_inputs(prompts[k], **fields), sender(k), lambda: False, timeout_us)
    wait_until(lambda: len(ends) == 1000 and service.responder.num_pending == 0, 120.0)
    longest = max(iteration_seconds)
    expired = 0
    for k, result in received.items():
        if not isinstance(result, Exception):
            assert result == texts[prompts[k]], k
            continue
        expired += 1
        assert isinstance(result, DeadlineExceeded) and due[k] is not None, (k, result)
        assert ends[k] - due[k] <= longest + 0.05, (k, ends[k] - due[k], longest)
    assert expired >= 100  # at least those due on arrival
    errors = [r for r in received.values() if isinstance(r, Exception)]
    assert any("while running" in str(r) for r in errors)  # some were stopped mid-answer
    assert failures(service)["deadline_exceeded"] == expired
    wait_until(lambda: not service.engine.has_unfinished_requests(), 10.0)
    assert_pool_released(service.engine)
