"""Steps that yield to an arrival (engine/step_interrupts.py), at the scheduler's level on the
fake runner of scheduler_helpers.py: `Order.outranks_step` says which arrivals a step yields to
under priority and fair share (never under fcfs), and a dropped step (block moves applied, K/V
half written, no update) leaves the scheduler able to go on: every output stays exact, every
block is accounted for, whatever the preemption mode, prefix sharing or tenants."""

from __future__ import annotations

import pytest

from tests.llm.core.scheduler_helpers import (
    FakeRunner,
    assert_reference_outputs,
    check_blocks,
    check_drained,
    check_step,
    make_scheduler,
    make_seq,
    step,
)


def flood(count: int, **kwargs):
    return [make_seq(range(10 * k, 10 * k + 20), max_tokens=6, **kwargs) for k in range(count)]


def outranks(sched, priority: int, tenant: str, out, arrival_time: float = 1e6) -> bool:
    """`Order.outranks_step` of an arrival (by default arriving after every sequence here)."""
    order, free_slots = sched.order, sched.config.max_num_seqs - len(sched.running)
    work = order.step_work(out.scheduled, free_slots)
    return order.outranks_step(priority, tenant, arrival_time, work)


def running_step(sched, runner, steps: int = 3):
    """Step `steps` times; the next step's output, scheduled but not run."""
    for _ in range(steps):
        step(sched, runner)
    out = sched.schedule()
    check_step(sched, out)
    return out


def test_under_priority_a_better_class_outranks_a_step_without_its_prefill():
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=3, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    for seq in flood(4, priority=1):
        sched.add(seq)
    out = running_step(sched, runner)
    assert {item.seq.priority for item in out.scheduled} == {1}
    assert outranks(sched, 0, "default", out)
    assert not outranks(sched, 1, "default", out)  # the same class: it waits its turn
    assert not outranks(sched, 2, "default", out)
    # A prefill of class 0 in the step: another class-0 arrival is served after it anyway, but a
    # class -1 one still outranks it.
    runner.execute_dropped(out)
    sched.add(make_seq(range(500, 520), priority=0, max_tokens=2))
    out = sched.schedule()
    assert any(item.seq.priority == 0 and not item.is_decode for item in out.scheduled)
    assert not outranks(sched, 0, "default", out)
    assert outranks(sched, -1, "default", out)


def test_under_aging_an_arrival_outranks_only_work_it_would_be_admitted_before():
    """With priority_aging_rate 1/s, a class-0 arrival 10 s after a class-1 flood is behind it
    (keys 10 and 1), so the step does not yield to it; half a second after, it is ahead."""
    sched = make_scheduler(
        scheduling_policy="priority",
        priority_aging_rate=1.0,
        max_num_seqs=3,
        max_num_batched_tokens=16,
    )
    runner = FakeRunner(sched)
    for seq in flood(4, priority=1, arrival_time=0.0):
        sched.add(seq)
    out = running_step(sched, runner)
    assert not outranks(sched, 0, "default", out, arrival_time=10.0)
    assert outranks(sched, 0, "default", out, arrival_time=0.5)


def test_under_fair_share_a_tenant_under_its_share_outranks_a_tenant_over_its_own():
    sched = make_scheduler(fair_share=True, max_num_seqs=4, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    for seq in flood(6, tenant="batch"):
        sched.add(seq)
    out = running_step(sched, runner)
    assert outranks(sched, 0, "chat", out)
    assert not outranks(sched, 0, "batch", out)  # the flood's own next request
    runner.execute_dropped(out)
    sched.add(make_seq(range(500, 520), tenant="chat", max_tokens=2))
    out = sched.schedule()  # chat displaced a batch sequence: its prefill is in the step
    assert any(item.seq.tenant == "chat" and not item.is_decode for item in out.scheduled)
    assert not outranks(sched, 0, "chat", out)
    assert outranks(sched, 0, "other", out)


def test_under_fair_share_an_idle_tenant_joining_outranks_a_step_with_a_free_slot():
    """The flood runs within its share with slots to spare: a request of a tenant with nothing
    queued or running would be admitted at the next step, so the step yields to it; the flood's
    own next request, or one of a tenant already busy, does not drop a step."""
    sched = make_scheduler(fair_share=True, max_num_seqs=8, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    for seq in [*flood(2, tenant="batch"), make_seq(range(600, 640), tenant="busy", max_tokens=9)]:
        sched.add(seq)
    out = running_step(sched, runner)
    assert len(sched.running) == 3 and not sched.tenants.over_share("batch", joining="chat")
    assert outranks(sched, 0, "chat", out)
    assert not outranks(sched, 0, "batch", out)
    assert not outranks(sched, 0, "busy", out)


def test_a_tenant_at_max_running_per_tenant_outranks_nothing():
    sched = make_scheduler(
        fair_share=True, max_num_seqs=4, max_num_batched_tokens=16, max_running_per_tenant=1
    )
    runner = FakeRunner(sched)
    for seq in [*flood(3, tenant="batch"), make_seq(range(600, 630), tenant="chat", max_tokens=9)]:
        sched.add(seq)
    out = running_step(sched, runner, steps=1)
    assert sched.tenants.running("chat") == 1
    assert not outranks(sched, 0, "chat", out)


def test_fcfs_never_yields():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    for seq in flood(4):
        sched.add(seq)
    out = running_step(sched, runner)
    assert not outranks(sched, 0, "chat", out)
    assert not outranks(sched, -5, "default", out)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["priority", "fair_share"])
def test_dropped_steps_leave_outputs_exact_and_blocks_accounted(mode, policy):
    """Every third step is dropped after its block moves, its new positions holding K/V no
    prefix has; with 12 blocks for mixed priorities (or a flood and two users) sharing prefixes,
    sequences are displaced, preempted (recompute or swap) and resumed around the dropped steps,
    and every output is still the fake model's, every block back at the end."""
    settings = {"scheduling_policy": "priority"} if policy == "priority" else {"fair_share": True}
    sched = make_scheduler(
        num_blocks=12,
        num_host_blocks=16,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        **settings,
    )
    runner = FakeRunner(sched, num_host_blocks=16)
    shared = list(range(200, 216))  # two full blocks every prompt shares: prefix-cache hits
    seqs = [
        make_seq(
            shared + list(range(300 + 7 * k, 305 + 7 * k)),
            priority=(k % 3) - 1 if policy == "priority" else 0,
            tenant="flood" if k < 5 else f"user{k % 2}",
            max_tokens=5 + k % 4,
        )
        for k in range(9)
    ]
    for seq in seqs[:5]:
        sched.add(seq)
    dropped = 0
    for k in range(400):
        if k == 4:
            for seq in seqs[5:]:
                sched.add(seq)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_step(sched, out)
        if k % 3 == 1:
            runner.execute_dropped(out)
            dropped += 1
        else:
            sched.update(out, runner.execute(out))
        check_blocks(sched)
    assert not sched.has_unfinished() and dropped > 5
    assert sched.num_preemptions > 0
    assert_reference_outputs(seqs)
    check_drained(sched)
