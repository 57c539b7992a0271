"""The encoders' micro-batch scheduler (backend_lib/encoder/scheduler.py) over a recording compute:
micro-batches within the budget, every item computed once and answered in order, jobs taken by
(priority, deadline, arrival) with the room left filled, a job answered as soon as its last item is
done, deadlines (waiting or part-computed), a failing micro-batch failing only its own jobs, stop,
and, on its own thread, a request arriving behind a flood waiting for at most the micro-batch in
flight."""

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
    scheduler.submit(job([16] * 6, answers, "late-flood"))
    scheduler.submit(job([16] * 2, answers, "deadline", deadline=far))
    scheduler.submit(job([16] * 2, answers, "urgent", priority=-1))
    scheduler.submit(job([2, 2], answers, "small", priority=5))
    assert scheduler.step()
    # The budget holds 4 items of 16: the urgent job's two, then the one with a deadline.
    assert compute.batches[0] == [16, 16, 16, 16]
    assert [name for name, _, _ in answers] == ["urgent", "deadline"]
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
