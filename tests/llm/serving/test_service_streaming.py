"""LLMService.responses: outputs queued while the sender is behind merge into one response with the
same text, cancellation is polled at a bounded rate and aborts the request, freeing its blocks."""

from __future__ import annotations

import threading
import time

import pytest

from tests.llm.engine_helpers import assert_pool_released, engine_checkpoint
from tests.llm.service_helpers import (
    MAX_TOKENS,
    PROMPTS,
    expected_texts,
    inputs,
    service_from_context,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def wait_finished(job, timeout: float = 30.0) -> None:
    """Until the engine has queued the job's final output (nothing consumed yet)."""
    deadline = time.monotonic() + timeout
    while job.stream._queue.qsize() == 0 or not job.stream._queue.queue[-1].finished:
        assert time.monotonic() < deadline, "the request did not finish"
        time.sleep(0.01)


def test_queued_outputs_merge_into_one_response_with_the_same_text():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    try:
        job = service.submit(inputs(PROMPTS[0]))
        wait_finished(job)
        assert job.stream._queue.qsize() == MAX_TOKENS  # one output per token was queued
        responses = list(service.responses(job))
        assert len(responses) == 1 and responses[0][1] is True
        (text,) = [b"".join(r["text_output"]).decode() for r, _ in responses]
        assert text == expected_texts(model_dir)[0]
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


def long_request() -> dict:
    request = inputs(PROMPTS[1])
    request["sampling_parameters"] = request["sampling_parameters"].copy()
    request["sampling_parameters"][0] = b'{"temperature": 0, "max_tokens": 100, "ignore_eos": true}'
    return request


def test_cancellation_is_polled_at_a_bounded_rate():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    calls: list[float] = []
    try:
        job = service.submit(long_request())
        started = time.monotonic()
        results = list(service.responses(job, lambda: calls.append(time.monotonic()) or False))
        elapsed = time.monotonic() - started
        assert results[-1][1] is True and not isinstance(results[-1][0], Exception)
        # At most one round trip to the server per 0.1 s, however many tokens streamed.
        assert 1 <= len(calls) <= 2 + elapsed / 0.1, (len(calls), elapsed)
    finally:
        service.shutdown()


def test_a_cancelled_request_is_aborted_and_its_blocks_freed():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    try:
        job = service.submit(long_request())
        results = list(service.responses(job, lambda: True))
        final, is_final = results[-1]
        assert is_final and "cancelled" in str(final)
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


# --- the responder thread (what model.py uses) ---------------------------------------------------


class Client:
    """Collects what the responder sends for one request."""

    def __init__(self, cancel_after: int | None = None, fail_on: int | None = None):
        self.texts: list[str] = []
        self.error: Exception | None = None
        self.final = threading.Event()
        self.cancel_after, self.fail_on = cancel_after, fail_on

    def send(self, result, final: bool) -> None:
        if self.fail_on is not None and len(self.texts) == self.fail_on:
            raise ConnectionError("client gone")
        if isinstance(result, Exception):
            self.error = result
        else:
            self.texts.append(b"".join(result["text_output"]).decode())
        if final:
            self.final.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.texts) >= self.cancel_after


def wait_responder_idle(service, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while service.responder.num_pending or service.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still pending"
        time.sleep(0.01)


def test_one_responder_streams_every_request_correctly():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    try:
        clients = [Client() for _ in range(6)]
        for i, client in enumerate(clients):
            service.start(inputs(PROMPTS[i % 2]), client.send, client.is_cancelled)
        expected = expected_texts(model_dir)
        for i, client in enumerate(clients):
            assert client.final.wait(30)
            assert client.error is None and "".join(client.texts) == expected[i % 2]
            assert 1 <= len(client.texts) <= MAX_TOKENS  # merged when the responder lagged
        wait_responder_idle(service)
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


def test_responder_aborts_cancelled_and_unreachable_clients_and_frees_their_blocks():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    # The responder polls cancellation every 0.1 s at most; on a fast machine the tiny model's
    # 100-token requests end sooner than that, so each token takes 5 ms more here (~0.5 s each).
    service.engine.fault_injector = lambda _request_id: time.sleep(0.005)
    try:
        cancelled, unreachable, normal = Client(cancel_after=1), Client(fail_on=1), Client()
        service.start(long_request(), cancelled.send, cancelled.is_cancelled)
        service.start(long_request(), unreachable.send, unreachable.is_cancelled)
        service.start(inputs(PROMPTS[0]), normal.send, normal.is_cancelled)
        assert cancelled.final.wait(30) and "cancelled" in str(cancelled.error)
        assert normal.final.wait(30) and "".join(normal.texts) == expected_texts(model_dir)[0]
        wait_responder_idle(service)  # the unreachable one was aborted, never finished
        assert not unreachable.final.is_set()
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


def test_shutdown_ends_running_requests_with_a_final_response():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    client = Client()
    service.start(long_request(), client.send, client.is_cancelled)
    service.shutdown()
    assert client.final.is_set()


def test_a_response_that_cannot_be_built_fails_that_request_alone(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    try:
        broken, normal = Client(), Client()
        real = service.response_tensors

        def response_tensors(job, output):
            if job.request.prompt == PROMPTS[1]:  # the long request's
                raise ValueError("bad tensor")
            return real(job, output)

        monkeypatch.setattr(service, "response_tensors", response_tensors)
        service.start(long_request(), broken.send, broken.is_cancelled)
        service.start(inputs(PROMPTS[0]), normal.send, normal.is_cancelled)
        assert broken.final.wait(30) and "bad tensor" in str(broken.error)
        assert normal.final.wait(30) and "".join(normal.texts) == expected_texts(model_dir)[0]
        wait_responder_idle(service)
        assert_pool_released(service.engine)
    finally:
        service.shutdown()
