"""LLMService.responses: outputs queued while the sender is behind merge into one response with the
same text, cancellation is polled at a bounded rate and aborts the request, freeing its blocks."""

from __future__ import annotations

import time

import pytest

from tests.llm.test_engine import (  # noqa: F401 (single_torch_thread is a fixture)
    assert_pool_released,
    engine_checkpoint,
    single_torch_thread,
)
from tests.llm.test_service_fault_hook import (
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
