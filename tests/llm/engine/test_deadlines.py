"""Request deadlines and the queue-wait limit in the engine (engine/deadlines.py): a request past
its deadline ends with deadline_exceeded whether waiting or running, one waiting past
max_queue_wait_ms with queue_timeout, each at the next step, its blocks freed and the other
requests' tokens unchanged; under load with random deadlines every request ends in time."""

from __future__ import annotations

import random
import time

import pytest

from backend_lib.config import ConfigError
from backend_lib.contract import ErrorCode
from backend_lib.llm.core.request import EngineRequest
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def run_all(engine) -> dict:
    """Step to the end; request id -> final output, and the seconds each step took."""
    finals, step_seconds = {}, []
    while engine.has_unfinished_requests():
        started = time.monotonic()
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        step_seconds.append(time.monotonic() - started)
    return finals, step_seconds


def test_a_waiting_request_past_its_deadline_is_dropped_and_the_other_is_untouched():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_num_seqs=1)
    busy = random_prompt(8, 1)
    engine.add(EngineRequest("busy", None, greedy(40), busy))
    engine.step()  # "busy" holds the one slot
    engine.add(
        EngineRequest(
            "late", None, greedy(4), random_prompt(5, 2), deadline=time.monotonic() + 0.01
        )
    )
    time.sleep(0.02)
    (late,) = [o for o in engine.step() if o.request_id == "late"]
    assert late.error_code is ErrorCode.DEADLINE_EXCEEDED and "while waiting" in late.error
    assert late.outputs[0].finish_reason == "error" and late.outputs[0].token_ids == []
    finals, _ = run_all(engine)
    assert finals["busy"].error is None
    assert finals["busy"].outputs[0].token_ids == hf_greedy(hf, busy, 40)
    assert_pool_released(engine)


def test_a_running_request_past_its_deadline_stops_at_the_next_step_and_frees_its_blocks():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    other = random_prompt(9, 3)
    engine.add(EngineRequest("other", None, greedy(30), other))
    deadline = time.monotonic() + 1.0  # far past three steps of this tiny model
    engine.add(EngineRequest("slow", None, greedy(100), random_prompt(20, 4), deadline=deadline))
    for _ in range(3):
        engine.step()
    assert time.monotonic() < deadline
    pool = engine.scheduler.kv_cache_manager.pool
    in_use = pool.num_blocks - pool.num_free_blocks
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
    (slow,) = [o for o in engine.step() if o.request_id == "slow"]
    assert slow.error_code is ErrorCode.DEADLINE_EXCEEDED and "while running" in slow.error
    assert len(slow.outputs[0].token_ids) == 3  # three steps ran, the fourth stopped it
    assert pool.num_blocks - pool.num_free_blocks < in_use  # its blocks went back
    finals, _ = run_all(engine)
    assert finals["other"].outputs[0].token_ids == hf_greedy(hf, other, 30)
    assert_pool_released(engine)


def test_an_expired_request_never_runs():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    now = time.monotonic()
    engine.add(
        EngineRequest("gone", None, greedy(4), random_prompt(5, 5), arrival_time=now, deadline=now)
    )
    (output,) = engine.step()
    assert output.finished and output.error_code is ErrorCode.DEADLINE_EXCEEDED
    assert output.metrics.first_scheduled_time is None
    assert_pool_released(engine)


def test_a_request_waiting_past_max_queue_wait_gets_queue_timeout():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_num_seqs=1, max_queue_wait_ms=40)
    first = random_prompt(6, 6)
    engine.add(EngineRequest("first", None, greedy(40), first))
    engine.step()  # admitted at once: the queue wait no longer applies to it
    engine.add(EngineRequest("second", None, greedy(4), random_prompt(6, 7)))
    engine.step()
    time.sleep(0.05)
    (second,) = [o for o in engine.step() if o.request_id == "second"]
    assert second.error_code is ErrorCode.QUEUE_TIMEOUT and "max_queue_wait_ms=40" in second.error
    finals, _ = run_all(engine)
    assert finals["first"].outputs[0].token_ids == hf_greedy(hf, first, 40)
    assert_pool_released(engine)


def test_a_bad_queue_wait_names_the_field():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    with pytest.raises(ConfigError, match="max_queue_wait_ms"):
        make_engine(model_dir, max_queue_wait_ms=-1)


def test_under_load_every_request_ends_in_full_or_within_a_step_of_its_deadline():
    """300 requests, some with deadlines already passed on arrival, some short, some none: each
    ends with its whole answer (transformers' tokens) or deadline_exceeded, none later than one
    step plus 50 ms after its deadline, and the pool is empty at the end."""
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_num_seqs=16)
    rng = random.Random(0)
    prompts, deadlines = {}, {}
    start = time.monotonic()
    for k in range(300):
        prompt = random_prompt(rng.randint(3, 12), 1000 + k)
        choice = rng.random()
        deadline = (
            None if choice < 0.3 else start - 1.0 if choice < 0.4 else start + rng.uniform(0, 2)
        )
        request_id = f"r{k}"
        prompts[request_id], deadlines[request_id] = prompt, deadline
        engine.add(EngineRequest(request_id, None, greedy(6), prompt, deadline=deadline))
    stepping = time.monotonic()  # a deadline due while the requests were being added counts here
    finals, step_seconds = run_all(engine)
    longest_step = max(step_seconds)
    assert set(finals) == set(prompts)
    expired = 0
    for request_id, output in finals.items():
        deadline = deadlines[request_id]
        if output.error is None:
            assert output.outputs[0].token_ids == hf_greedy(hf, prompts[request_id], 6)
            continue
        expired += 1
        assert output.error_code is ErrorCode.DEADLINE_EXCEEDED and deadline is not None
        due = max(deadline, stepping)
        assert output.metrics.finished_time - due <= longest_step + 0.05, request_id
    assert expired >= 30  # at least those already expired on arrival
    assert_pool_released(engine)
