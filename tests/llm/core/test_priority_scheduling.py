"""`scheduling_policy: priority` (core/request_queue.py) on the fake runner of scheduler_helpers.py:
admission by (priority, arrival), a better-priority arrival displacing the worst running
sequence, the worst priority preempted first when blocks run out, aging's bound, and outputs
that stay exact whatever the order."""

from __future__ import annotations

import pytest

from backend_lib.config import ConfigError, from_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.lora.request import LoRARequest
from tests.llm.core.scheduler_helpers import (
    FakeRunner,
    assert_reference_outputs,
    make_scheduler,
    make_seq,
    run,
    step,
)


def first_scheduled_order(sched, runner) -> list[int]:
    """Run to the end; the seq ids in the order each was first scheduled."""
    order: list[int] = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        order += [i.seq.seq_id for i in out.scheduled if i.seq.seq_id not in order]
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    runner = FakeRunner(sched)
    seqs = [
        make_seq(range(10 * k, 10 * k + 5), priority=p, max_tokens=3)
        for k, p in enumerate((2, 0, 1, 0, -1))
    ]
    for seq in seqs:
        sched.add(seq)
    order = first_scheduled_order(sched, runner)
    assert order == [seqs[i].seq_id for i in (4, 1, 3, 2, 0)]
    assert_reference_outputs(seqs)


def test_fcfs_ignores_priority_order():
    """The contrast: the same requests under fcfs run in arrival order."""
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    seqs = [make_seq(range(10 * k, 10 * k + 5), max_tokens=3) for k in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert first_scheduled_order(sched, runner) == [s.seq_id for s in seqs]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_better_priority_behind_200_queued_ones_runs_at_the_next_step(policy):
    """Every slot busy with long low-priority requests and 200 more queued: under priority the
    new request displaces the worst running one and is scheduled at the very next step; under
    fcfs it waits behind all of them."""
    sched = make_scheduler(
        num_blocks=256, max_model_len=64, scheduling_policy=policy, max_num_seqs=4
    )
    runner = FakeRunner(sched)
    low = [
        make_seq(range(k, k + 6), priority=5 if policy == "priority" else 0, max_tokens=40)
        for k in range(204)
    ]
    for seq in low:
        sched.add(seq)
    for _ in range(3):
        step(sched, runner)
    assert len(sched.running) == 4 and len(sched.waiting) == 200
    urgent = make_seq(range(500, 506), max_tokens=4)
    sched.add(urgent)
    out, _ = step(sched, runner)
    scheduled = {i.seq.seq_id for i in out.scheduled}
    if policy == "priority":
        assert urgent.seq_id in scheduled
        assert [s.seq_id for s in out.preempted] == [low[3].seq_id]  # the last admitted of equals
        assert len(sched.running) == 4
    else:
        assert urgent.seq_id not in scheduled and not out.preempted
    run(sched, runner, max_steps=5000)
    assert_reference_outputs([*low, urgent])


def test_equal_priorities_never_displace_each_other():
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
    runner = FakeRunner(sched)
    first = [make_seq(range(k, k + 4), priority=1, max_tokens=10) for k in range(2)]
    for seq in first:
        sched.add(seq)
    step(sched, runner)
    later = make_seq(range(50, 54), priority=1, max_tokens=2)
    sched.add(later)
    out, _ = step(sched, runner)
    assert not out.preempted and later.seq_id not in {i.seq.seq_id for i in out.scheduled}
    run(sched, runner)
    assert_reference_outputs([*first, later])


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_better_request_s_prompt_goes_before_a_worse_running_chunked_prefill(policy):
    """A long worse prompt is being prefilled in 16-token chunks when a better short one arrives:
    under priority the new prompt's step carries no chunk of the worse one (one class's prefills a
    step, so the better first token comes sooner), no preemption, and the long prefill goes on at
    the next step; under fcfs the long prefill keeps the whole budget."""
    sched = make_scheduler(
        max_model_len=128,
        scheduling_policy=policy,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    runner = FakeRunner(sched)
    long = make_seq(range(100), priority=5 if policy == "priority" else 0, max_tokens=4)
    sched.add(long)
    step(sched, runner)
    urgent = make_seq(range(200, 206), max_tokens=4)
    sched.add(urgent)
    out, _ = step(sched, runner)
    chunks = [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled]
    if policy == "priority":
        assert chunks == [(urgent.seq_id, 6)] and not out.preempted
        out, _ = step(sched, runner)
        assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [
            (urgent.seq_id, 1),
            (long.seq_id, 15),
        ]
    else:
        assert chunks == [(long.seq_id, 16)]
    run(sched, runner)
    assert_reference_outputs([long, urgent])


def test_a_step_admitting_a_better_prompt_admits_no_worse_one():
    """Budget for all four prompts, but the step that prefills the better one carries none of the
    worse ones; they start at the next step, beside its decode."""
    sched = make_scheduler(scheduling_policy="priority", max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    worse = [make_seq(range(10 * k, 10 * k + 6), priority=1, max_tokens=3) for k in range(3)]
    urgent = make_seq(range(100, 106), max_tokens=3)
    for seq in (*worse, urgent):
        sched.add(seq)
    out, _ = step(sched, runner)
    assert [i.seq.seq_id for i in out.scheduled] == [urgent.seq_id]
    out, _ = step(sched, runner)
    assert [i.seq.seq_id for i in out.scheduled] == [urgent.seq_id] + [s.seq_id for s in worse]
    run(sched, runner)
    assert_reference_outputs([*worse, urgent])


def test_a_worse_prefill_runs_when_the_better_prompt_cannot_start():
    """The better waiting request needs a second LoRA adapter while one slot is in use, so it can
    neither start nor displace: the worse running prefill keeps the budget rather than leave it
    idle, and the better one starts once the adapter slot frees."""
    sched = make_scheduler(
        max_model_len=128,
        scheduling_policy="priority",
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        enable_lora=True,
        max_loras=1,
    )
    runner = FakeRunner(sched)
    long = make_seq(range(100), priority=5, max_tokens=4)
    long.lora_request = LoRARequest("a", 1, "", adapter=None)
    sched.add(long)
    step(sched, runner)
    urgent = make_seq(range(200, 206), max_tokens=4)
    urgent.lora_request = LoRARequest("b", 2, "", adapter=None)
    sched.add(urgent)
    out, _ = step(sched, runner)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(long.seq_id, 16)]
    run(sched, runner)
    assert_reference_outputs([long, urgent])


def test_an_outranked_prefill_without_blocks_waits_instead_of_preempting():
    """The better prompt took the last free blocks: the worse prefill's chunk is not scheduled
    this step and evicts nobody, and both finish exactly."""
    sched = make_scheduler(
        num_blocks=16,
        max_model_len=120,
        scheduling_policy="priority",
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
    )
    runner = FakeRunner(sched)
    long = make_seq(range(100), priority=5, max_tokens=4)
    sched.add(long)
    step(sched, runner)  # 64 tokens: 8 of the 16 blocks
    urgent = make_seq(range(200, 262), max_tokens=4)  # 62 tokens: the other 8
    sched.add(urgent)
    out, _ = step(sched, runner)
    assert [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled] == [(urgent.seq_id, 62)]
    assert not out.preempted
    run(sched, runner)
    assert_reference_outputs([long, urgent])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_when_blocks_run_out_the_worst_priority_is_preempted_first(mode):
    """Four running sequences grow until the pool is short: the victim is the one of priority 9
    although it was admitted first, then the one of priority 3; the best keeps running."""
    sched = make_scheduler(
        num_blocks=8,
        num_host_blocks=16,
        max_model_len=64,
        scheduling_policy="priority",
        preemption_mode=mode,
        swap_space=1,
    )
    runner = FakeRunner(sched, num_host_blocks=16)
    priorities = (9, 0, 3, 1)
    seqs = [
        make_seq(range(10 * k, 10 * k + 7), priority=p, max_tokens=20)
        for k, p in enumerate(priorities)
    ]
    for seq in seqs:
        sched.add(seq)
    victims = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        victims += [s.seq_id for s in out.preempted]
    assert victims[:2] == [seqs[0].seq_id, seqs[2].seq_id]
    assert seqs[1].num_preemptions == 0
    assert_reference_outputs(seqs)


def test_a_worse_waiting_request_never_overtakes_a_better_swapped_one():
    """Swap mode: S (priority 5) is swapped out by better running ones; then W1 (0) and W2 (9)
    arrive. W1 goes before S, but W2 may not run while S waits swapped."""
    sched = make_scheduler(
        num_blocks=6,
        num_host_blocks=16,
        max_model_len=48,
        scheduling_policy="priority",
        preemption_mode="swap",
        swap_space=1,
    )
    runner = FakeRunner(sched, num_host_blocks=16)
    good = [make_seq(range(10 * k, 10 * k + 7), priority=1, max_tokens=30) for k in range(2)]
    worse = make_seq(range(50, 57), priority=5, max_tokens=30)
    for seq in (*good, worse):
        sched.add(seq)
    while worse.status is not worse.status.SWAPPED:
        step(sched, runner)
    first, last = (
        make_seq(range(70, 73), priority=0, max_tokens=2),
        make_seq(range(80, 83), priority=9, max_tokens=2),
    )
    sched.add(first)
    sched.add(last)
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        scheduled = {i.seq.seq_id for i in out.scheduled}
        if last.seq_id in scheduled:
            assert worse.status is not worse.status.SWAPPED
    assert_reference_outputs([*good, worse, first, last])


def aging_scenario(rate: float) -> tuple[list[int], int, list]:
    """A priority-3 request arriving at t=0 and a stream of priority-0 ones arriving at t=0.5,
    1.5, ..., one slot: (first-scheduled order, the old one's id, the stream)."""
    sched = make_scheduler(scheduling_policy="priority", priority_aging_rate=rate, max_num_seqs=1)
    old = make_seq(range(5), priority=3, arrival_time=0.0, max_tokens=2)
    stream = [
        make_seq(range(10 + t, 15 + t), priority=0, arrival_time=t + 0.5, max_tokens=2)
        for t in range(8)
    ]
    for seq in (old, *stream):
        sched.add(seq)
    return first_scheduled_order(sched, FakeRunner(sched)), old.seq_id, stream


def test_aging_admits_a_worse_priority_within_its_bound():
    """Aging 1 level/s: the priority-3 request goes after the priority-0 ones that arrived within
    (3 - 0) / 1 = 3 s of it and before every later one; without aging it goes last."""
    order, old, stream = aging_scenario(1.0)
    assert set(order[: order.index(old)]) == {s.seq_id for s in stream if s.arrival_time < 3.0}
    order, old, _ = aging_scenario(0.0)
    assert order[-1] == old


def test_a_bad_policy_or_aging_rate_names_the_field():
    with pytest.raises(ConfigError, match="scheduling_policy"):
        from_parameters(LLMConfig, {"scheduling_policy": "lottery"})
    with pytest.raises(ConfigError, match="priority_aging_rate"):
        make_scheduler(scheduling_policy="priority", priority_aging_rate=-1.0)
