"""The encoders' micro-batch scheduler (backend_lib/encoder/scheduler.py) over a recording compute:
micro-batches within the budget, every item computed once and answered in order, jobs taken by
(priority, deadline, arrival) with the room left filled by jobs of the same priority, a job
answered as soon as its last item is done, deadlines (waiting or part-computed), a failing
micro-batch failing only its own jobs, stop, and, on its own thread, a request arriving behind a
flood waiting for at most the micro-batch in flight, or with the priority lane not even that: it
is computed beside it, and a job split between the lanes is answered once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from backend_lib.encoder.batching import MicroBatch
from backend_lib.encoder.scheduler import EncoderJob, EncoderScheduler
from backend_lib.errors import DeadlineExceeded, ModelUnavailable

TOKENS, SIZE = 64, 8


class Recorder:
    """A compute whose "model" maps an item (a token count) to 10x it, recording each batch."""

    def __init__(self, delay: float = 0.0, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.delay, self.fail_on = delay, fail_on
        self.started = threading.Event()

    def __call__(self, items: list[int]) -> tuple[np.ndarray, list[MicroBatch]]:
        self.batches.append(list(items))
        self.started.set()
        time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError("boom")
        report = MicroBatch(list(range(len(items))), len(items) * max(items), sum(items), 0.0)
        return np.array([[10.0 * item] for item in items]), [report]


def job(items, answers, name, **kwargs) -> EncoderJob:
    def done(values, error):
        answers.append((name, values, error))

    return EncoderJob(list(items), list(items), done, **kwargs)


def test_batches_fit_the_budget_and_every_item_is_answered_in_order():
    compute, answers = Recorder(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    lengths = [[5, 30, 7, 16], [3] * 20, [60], [12, 9, 31, 2, 2, 8]]
    for k, items in enumerate(lengths):
        scheduler.submit(job(items, answers, k))
    scheduler.run_until_idle()
    for batch in compute.batches:
        assert len(batch) <= SIZE and len(batch) * max(batch) <= TOKENS
    assert sorted(x for b in compute.batches for x in b) == sorted(x for i in lengths for x in i)
    assert {name for name, _, _ in answers} == set(range(len(lengths)))
    for name, values, error in answers:
        assert error is None
        np.testing.assert_array_equal(values[:, 0], 10.0 * np.array(lengths[name]))


def test_jobs_go_by_priority_then_deadline_then_arrival_and_fill_the_room_left():
    compute, answers = Recorder(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    far = time.monotonic() + 3600
    scheduler.submit(job([16] * 4, answers, "late-flood"))
    scheduler.submit(job([16] * 2, answers, "deadline", deadline=far))
    scheduler.submit(job([16] * 2, answers, "urgent", priority=-1))
    scheduler.submit(job([2, 2], answers, "small"))
    assert scheduler.step()
    # The urgent job's micro-batch carries none of the worse jobs' items: it is done sooner.
    assert compute.batches[0] == [16, 16]
    assert [name for name, _, _ in answers] == ["urgent"]
    scheduler.step()
    # The budget holds 4 items of 16: the job with a deadline's two, then the flood's.
    assert compute.batches[1] == [16, 16, 16, 16]
    scheduler.run_until_idle()
    assert [name for name, _, _ in answers] == ["urgent", "deadline", "late-flood", "small"]
    # The small job's short items filled the room the flood's last batch left.
    assert compute.batches[-1] == [16, 16, 2, 2]


def test_a_job_past_its_deadline_is_answered_without_its_remaining_items():
    compute, answers = Recorder(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    scheduler.submit(job([16] * 8, answers, "slow", deadline=time.monotonic() + 3600))
    scheduler.submit(job([4], answers, "expired", deadline=time.monotonic() - 1))
    scheduler.step()  # "expired" answered before any compute; "slow" half done
    slow = next(j for j in scheduler._jobs)
    slow.deadline = time.monotonic() - 1
    scheduler.run_until_idle()
    assert [name for name, _, _ in answers] == ["expired", "slow"]
    for _, values, error in answers:
        assert values is None and isinstance(error, DeadlineExceeded)
    assert "4 of 8 items computed" in str(answers[1][2])
    assert compute.batches == [[16, 16, 16, 16]]  # nothing computed for either after expiry


def test_a_failing_micro_batch_fails_its_own_jobs_only():
    compute, answers = Recorder(fail_on=50), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    scheduler.submit(job([50], answers, "poison", priority=-1))
    scheduler.submit(job([30, 30], answers, "healthy"))
    scheduler.run_until_idle()
    (poison,) = [a for a in answers if a[0] == "poison"]
    (healthy,) = [a for a in answers if a[0] == "healthy"]
    assert isinstance(poison[2], RuntimeError) and "boom" in str(poison[2])
    assert healthy[2] is None and healthy[1][:, 0].tolist() == [300.0, 300.0]


def test_stop_answers_waiting_jobs_unavailable_once():
    compute, answers = Recorder(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    scheduler.submit(job([8], answers, "waiting"))
    scheduler.stop()
    scheduler.run_until_idle()
    ((name, values, error),) = answers
    assert name == "waiting" and values is None and isinstance(error, ModelUnavailable)
    with pytest.raises(ModelUnavailable):
        scheduler.submit(job([8], answers, "after"))


def test_on_its_thread_an_arrival_behind_a_flood_waits_for_one_micro_batch():
    """A flood of 40 full micro-batches is being computed; a small job of better priority
    arriving then is answered after the micro-batch in flight and its own, not after the flood."""
    compute, answers = Recorder(delay=0.02), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    scheduler.start()
    try:
        for k in range(10):
            scheduler.submit(job([16] * 16, answers, f"flood-{k}"))
        assert compute.started.wait(10)
        answered, seen = threading.Event(), {}

        def done(values, error):
            seen.update(batches=len(compute.batches), floods=len(answers), error=error)
            answered.set()

        before = len(compute.batches)
        scheduler.submit(EncoderJob([3], [3], done, priority=-1))
        assert answered.wait(10) and seen["error"] is None
        assert seen["batches"] - before <= 2  # the one in flight, then its own
        assert seen["floods"] < 10  # the flood (40 micro-batches) was not finished
    finally:
        scheduler.stop(timeout=10)


class Gated(Recorder):
    """A Recorder whose micro-batches holding an item of a gated length wait for that gate (by
    default the flood's items, 16 tokens)."""

    def __init__(self, gated=(16,)) -> None:
        super().__init__()
        self.gates = {length: threading.Event() for length in gated}
        self.gate = self.gates[16]
        self.waiting = {length: threading.Event() for length in gated}
        self.entered: list[list[int]] = []
        """Every micro-batch as it starts (before any gate)."""

    def __call__(self, items: list[int]) -> tuple[np.ndarray, list[MicroBatch]]:
        self.entered.append(list(items))
        for length, gate in self.gates.items():
            if length in items:
                self.started.set()
                self.waiting[length].set()
                assert gate.wait(10)
        return super().__call__(items)

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


def test_the_priority_lane_answers_a_better_job_while_the_flood_s_batch_is_in_flight():
    """The flood's micro-batch cannot finish (its gate is shut), yet a job of better priority
    arriving then is computed on the lane and answered; the flood goes on once the gate opens."""
    compute, answers = Gated(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE, lane_tokens=16)
    scheduler.start()
    try:
        for k in range(3):
            scheduler.submit(job([16] * 8, answers, f"flood-{k}"))
        assert compute.started.wait(10)
        answered = threading.Event()
        scheduler.submit(job([3, 5], answers, "urgent", priority=-1))
        scheduler.submit(EncoderJob([2], [2], lambda v, e: answered.set(), priority=-1))
        assert answered.wait(10)
        assert [name for name, _, _ in answers] == ["urgent"]  # the flood's batch still waits
        ((_, values, error),) = answers
        assert error is None and values[:, 0].tolist() == [30.0, 50.0]
        compute.gate.set()
        deadline = time.monotonic() + 10
        while len(answers) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(name for name, _, _ in answers) == ["flood-0", "flood-1", "flood-2", "urgent"]
    finally:
        compute.open_all()
        scheduler.stop(timeout=10)


def test_a_job_split_between_the_lanes_is_answered_once_with_every_value():
    """A better job larger than the lane's budget: the lane takes what fits, and the main lane,
    its flood batch done, takes the rest while the lane still computes; the job's answer comes
    once both are done, with all its values in order."""
    compute, answers = Gated(gated=(16, 4)), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE, lane_tokens=8)
    scheduler.start()
    try:
        scheduler.submit(job([16] * 4, answers, "flood"))
        assert compute.waiting[16].wait(10)
        scheduler.submit(job([4, 4, 4, 4, 3, 2], answers, "big", priority=-1))
        assert compute.waiting[4].wait(10)  # the lane holds [4, 4]
        compute.gates[16].set()  # the flood's batch ends; the main lane takes big's rest
        deadline = time.monotonic() + 10
        while len(compute.entered) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(map(sorted, compute.entered[1:])) == [[2, 3, 4, 4], [4, 4]]
        assert [name for name, _, _ in answers] == ["flood"]  # big: both parts still held
        compute.open_all()
        while len(answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        (big,) = [a for a in answers if a[0] == "big"]
        assert big[2] is None
        assert big[1][:, 0].tolist() == [40.0, 40.0, 40.0, 40.0, 30.0, 20.0]
    finally:
        compute.open_all()
        scheduler.stop(timeout=10)


def test_without_a_lane_a_better_job_waits_for_the_batch_in_flight():
    compute, answers = Gated(), []
    scheduler = EncoderScheduler(compute, TOKENS, SIZE)
    scheduler.start()
    try:
        scheduler.submit(job([16] * 4, answers, "flood"))
        assert compute.started.wait(10)
        scheduler.submit(job([3], answers, "urgent", priority=-1))
        time.sleep(0.2)
        assert answers == []
        compute.gate.set()
        deadline = time.monotonic() + 10
        while len(answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [name for name, _, _ in answers] == ["flood", "urgent"]
    finally:
        compute.open_all()
        scheduler.stop(timeout=10)
