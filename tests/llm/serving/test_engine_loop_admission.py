"""EngineLoop admission: a request `submit` accepted is never refused later. `submit` counts the queue
as of the previous step; when the engine's own queue has filled meanwhile (sequences preempted back
into it), the request waits for a later step instead of failing with "queue full" (found by the
overload scenario of tests/e2e/test_reliability.py). Aborting it while it waits ends it at once.
A submission that outranks the step in flight makes that step yield (engine/step_interrupts.py)."""

from __future__ import annotations

import time

import pytest

from backend_lib.errors import TenantLimitError
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.serving.engine_loop import EngineLoop
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tests.llm.serving.engine_loop_helpers import collect
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")
QUEUE = 2


def loop_with_engine_queue_refilled_after_submit(prompt: list[int]):
    """(loop, engine, stream of "late"): "late" is accepted by submit, then the engine's queue is
    filled directly (the loop thread is not started yet, so nothing else touches the engine)."""
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_queue_size=QUEUE)
    loop = EngineLoop(engine)
    stream = loop.submit(EngineRequest("late", None, greedy(6), prompt_token_ids=prompt))
    for i in range(QUEUE):
        engine.add_request(f"filler-{i}", None, greedy(6), prompt_token_ids=random_prompt(5, i))
    return loop, engine, stream


def stop_when_fillers_finished(loop: EngineLoop, engine) -> None:
    """The fillers bypassed the loop, so `stop` would not abort them: let them finish first."""
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop(timeout=60)


def test_a_submitted_request_enters_after_the_queue_drains_instead_of_failing():
    prompt = random_prompt(7, 42)
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    (expected,) = make_engine(model_dir).generate([prompt], greedy(6))
    loop, engine, stream = loop_with_engine_queue_refilled_after_submit(prompt)
    loop.start()
    try:
        final = collect(stream)[-1]
        assert final.error is None
        assert final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
    finally:
        stop_when_fillers_finished(loop, engine)
    assert_pool_released(engine)


def test_aborting_a_request_that_waits_for_admission_ends_it():
    loop, engine, stream = loop_with_engine_queue_refilled_after_submit(random_prompt(7, 43))
    loop.abort("late")  # handled in the same iteration that finds the engine queue full
    loop.start()
    try:
        final = collect(stream)[-1]
        assert final.error is None and final.outputs[0].finish_reason == "abort"
    finally:
        stop_when_fillers_finished(loop, engine)
    assert_pool_released(engine)


def test_submit_refuses_a_tenant_past_max_queued_per_tenant_in_the_caller_s_thread():
    """The per-tenant queue limit is checked when submitted (429 for that caller), counting the
    requests submitted since the last step; another tenant is still accepted, and the accepted
    ones all finish once the loop runs."""
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_queued_per_tenant=2)
    loop = EngineLoop(engine)
    streams = [
        loop.submit(EngineRequest(f"a{k}", None, greedy(3), random_prompt(5, k), tenant="a"))
        for k in range(2)
    ]
    with pytest.raises(TenantLimitError, match="tenant 'a' has 2 requests waiting"):
        loop.submit(EngineRequest("a2", None, greedy(3), random_prompt(5, 9), tenant="a"))
    streams.append(loop.submit(EngineRequest("b0", None, greedy(3), random_prompt(5, 3))))
    loop.start()
    try:
        for stream in streams:
            final = collect(stream)[-1]
            assert final.error is None and final.outputs[0].finish_reason == "length"
    finally:
        loop.stop(timeout=60)
    assert_pool_released(engine)


def test_a_step_in_flight_yields_to_an_outranking_submission():
    """Under priority, a request submitted while a step of the flood runs (here: as that step
    starts) is seen by the step at its first layer boundary, which yields; the loop adds it and
    it is served next, with transformers' tokens, and the loop's stats count the dropped step."""
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(
        model_dir, scheduling_policy="priority", max_num_seqs=2, max_num_batched_tokens=16
    )
    observed = []
    loop = EngineLoop(engine, on_step=observed.append)
    flood = [
        loop.submit(EngineRequest(f"f{k}", None, greedy(12), random_prompt(24, k), priority=1))
        for k in range(3)
    ]
    urgent_prompt, streams = random_prompt(6, 50), []
    plan = engine.interrupts.interrupt_for

    def submit_as_the_third_step_starts(*step):
        if len(observed) == 2 and not streams:
            request = EngineRequest("urgent", None, greedy(4), urgent_prompt, priority=0)
            streams.append(loop.submit(request))  # on the loop thread, as the step starts
        return plan(*step)

    engine.interrupts.interrupt_for = submit_as_the_third_step_starts
    loop.start()
    urgent = collect(streams[0]) if _wait_for(lambda: streams) else []
    rest = [collect(stream) for stream in flood]
    loop.stop()
    assert engine.interrupts.count == 1
    assert observed[-1].counters.steps_interrupted == 1
    assert urgent[-1].outputs[0].token_ids == hf_greedy(hf, urgent_prompt, 4)
    assert all(outputs[-1].outputs[0].finish_reason == "length" for outputs in rest)
    assert_pool_released(engine)


def _wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def test_a_request_the_engine_refused_for_now_drops_no_step():
    """A class-0 request accepted by submit but refused by the full engine queue waits outside
    it; the class-1 steps meanwhile do not yield to it (the next step could not take it)."""
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(
        model_dir, scheduling_policy="priority", max_queue_size=QUEUE, max_num_seqs=1
    )
    loop = EngineLoop(engine)
    stream = loop.submit(EngineRequest("late", None, greedy(4), random_prompt(6, 9), priority=0))
    for i in range(QUEUE):
        engine.add(EngineRequest(f"filler-{i}", None, greedy(6), random_prompt(5, i), priority=1))
    loop.start()
    assert collect(stream)[-1].outputs[0].finish_reason == "length"
    stop_when_fillers_finished(loop, engine)
    assert engine.interrupts.count == 0
    assert_pool_released(engine)
