"""The encoders' micro-batch scheduler: requests (jobs) from every execute call wait in one queue,
and each micro-batch is chosen anew, so a request arriving behind a flood waits for at most the
micro-batch being computed.

Policy, per micro-batch:

1. Jobs past their deadline (Triton's request timeout) are answered with deadline_exceeded, their
   items dropped (a job being computed stops at the next micro-batch boundary).
2. Jobs are ordered by (priority, lower first; deadline, earliest first, none last; arrival).
3. The first job's items, longest first, fill the micro-batch within the budget (items x longest
   item <= `max_batch_tokens`, items <= `max_batch_size`); the room left is filled with the next
   jobs' items in that order, longest first, as long as they fit, but only from jobs of the first
   one's priority: a better job's micro-batch carries no worse items, so it is done sooner (a
   small interactive request beside a flood waits for the micro-batch in flight and its own short
   one).

A job is answered as soon as its last item is computed. A micro-batch that fails fails every job
with an item in it; the others go on. Results do not depend on the order: each item is computed
alone (packed sequences, no padding), so a vector or score is the same whatever shares its batch.

The priority lane (`lane_tokens` > 0, on its own thread once started): a forward cannot be cut
short, so a job of better priority than the micro-batch in flight would wait for it. The lane
computes such jobs at once, beside it, in micro-batches of at most `lane_tokens` padded tokens (on
CUDA, on a high-priority stream: `lane_context`). Only encoders whose forwards may run
concurrently get a lane (the service decides).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend_lib.encoder.batching import MicroBatch
from backend_lib.errors import DeadlineExceeded, ModelUnavailable

logger = logging.getLogger(__name__)

Compute = Callable[[list], tuple[Any, list[MicroBatch]]]
"""Computes items (one micro-batch's) -> (their values in order: an array or a list, report)."""


@dataclass(eq=False)
class EncoderJob:
    """One request's items, waiting or partly computed."""

    items: list
    """Tokenized items, as the service's compute takes them."""
    lengths: list[int]
    """Tokens of each item (the budget's unit)."""
    on_done: Callable[[Any, Exception | None], None]
    """Called once, on the scheduler's thread: (values of every item in order, None) or
    (None, the error)."""
    priority: int = 0
    """Lower first (as the llm's `priority`)."""
    deadline: float | None = None
    """time.monotonic() by which it must be answered (None: none)."""
    arrival: float = field(default_factory=time.monotonic)
    seq: int = 0
    """Submission order (set by the scheduler)."""
    values: Any = None
    """The computed values, filled as micro-batches finish."""
    remaining: list[int] = field(default_factory=list)
    """Indices of the items not computed yet, longest first."""
    in_flight: int = 0
    """Items being computed (on either lane)."""
    answered: bool = False

    def answer(self, values: Any, error: Exception | None) -> None:
        """Call `on_done` once (a later call is ignored: e.g. a job answered UNAVAILABLE by `stop`
        while its micro-batch ran); a failing callback is logged, the scheduler goes on."""
        if self.answered:
            return
        self.answered = True
        try:
            self.on_done(values, error)
        except Exception:
            logger.exception("an encoder job's callback failed")

    def key(self) -> tuple[int, float, int]:
        return self.priority, math.inf if self.deadline is None else self.deadline, self.seq


class EncoderScheduler:
    """The queue and the micro-batch loop: driven by `step` (tests, `run_until_idle`), or by its
    own thread after `start`."""

    def __init__(
        self,
        compute: Compute,
        max_batch_tokens: int,
        max_batch_size: int,
        on_batch: Callable[[list[tuple[EncoderJob, int]], MicroBatch, float], None] | None = None,
        lane_tokens: int = 0,
        lane_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """`on_batch(members, report, started)`: after each micro-batch, its (job, item index)
        members, what it did and when it started (time.monotonic()), for the metrics (called on
        either lane). `lane_tokens`: the priority lane's budget (0: no lane); `lane_context`: what
        its forwards run in."""
        self.compute = compute
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.on_batch = on_batch
        self.lane_tokens, self.lane_context = lane_tokens, lane_context
        self._jobs: list[EncoderJob] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._in_flight: int | None = None
        """The priority of the main lane's micro-batch being computed (None: idle)."""

    # --- callers' side -------------------------------------------------------------------------

    def submit(self, job: EncoderJob) -> None:
        """Queue a job (answered at once when it has no items)."""
        job.seq = next(self._seq)
        job.remaining = sorted(range(len(job.items)), key=lambda i: -job.lengths[i])
        if not job.items:
            job.answer([], None)
            return
        with self._cond:
            if self._stopping:
                raise ModelUnavailable("the model is being unloaded")
            self._jobs.append(job)
            self._cond.notify_all()

    def start(self) -> None:
        """Run micro-batches on a thread of its own from now on, and the priority lane on
        another."""
        loops = [("encoder-scheduler", self._run)]
        if self.lane_tokens > 0:
            loops.append(("encoder-priority-lane", self._run_lane))
        for name, loop in loops:
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def threaded(self) -> bool:
        return bool(self._threads)

    def stop(self, timeout: float | None = None) -> None:
        """Answer every waiting job with UNAVAILABLE and join the threads."""
        with self._cond:
            self._stopping = True
            jobs, self._jobs = self._jobs, []
            self._cond.notify_all()
        for job in jobs:
            job.answer(None, ModelUnavailable("the model is being unloaded"))
        for thread in self._threads:
            thread.join(timeout)

    def run_until_idle(self) -> None:
        """Run micro-batches in the caller's thread until no job is left (without a thread)."""
        while self.step():
            pass

    # --- the loop --------------------------------------------------------------------------------

    def step(self) -> bool:
        """Expire, choose and compute one micro-batch; False when no item was waiting."""
        with self._cond:
            self._expire(time.monotonic())
            members = self._choose(self._jobs, self.max_batch_tokens)
            self._in_flight = members[0][0].priority if members else None
        try:
            if members:
                self._compute(members)
        finally:
            with self._cond:
                self._in_flight = None
        return bool(members)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_items() and not self._stopping:
                    self._cond.wait(self._seconds_to_next_deadline())
                if self._stopping:
                    return
            self.step()

    def _run_lane(self) -> None:
        """The priority lane: jobs better than the main lane's micro-batch in flight."""
        while True:
            with self._cond:
                while not (members := self._choose_lane()) and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            with self.lane_context():
                self._compute(members)

    def _choose_lane(self) -> list[tuple[EncoderJob, int]]:
        if self._in_flight is None:
            return []  # the main lane is free: it takes them
        better = [job for job in self._jobs if job.priority < self._in_flight and job.remaining]
        return self._choose(better, self.lane_tokens) if better else []

    def _has_items(self) -> bool:
        return any(job.remaining for job in self._jobs)

    def _compute(self, members: list[tuple[EncoderJob, int]]) -> None:
        """Compute chosen members (taken off their jobs' remaining), store their values, answer
        the jobs they complete."""
        started = time.monotonic()
        try:
            values, reports = self.compute([job.items[i] for job, i in members])
        except Exception as exc:  # that micro-batch's jobs fail; the others go on
            self._fail({job for job, _ in members}, exc)
            return
        with self._cond:
            for row, (job, index) in enumerate(members):
                _store(job, index, values[row])
                job.in_flight -= 1
            jobs = dict.fromkeys(job for job, _ in members)
            done = [job for job in jobs if not job.remaining and not job.in_flight]
            self._jobs = [job for job in self._jobs if job not in done]
            self._cond.notify_all()
        if self.on_batch is not None:
            report = reports[0] if len(reports) == 1 else _merged(reports)
            self.on_batch(members, report, started)
        for job in done:
            job.answer(job.values, None)

    def _seconds_to_next_deadline(self) -> float | None:
        deadlines = [job.deadline for job in self._jobs if job.deadline is not None]
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic())

    def _expire(self, now: float) -> None:
        for job in [j for j in self._jobs if j.deadline is not None and j.deadline <= now]:
            self._jobs.remove(job)
            waited = now - job.arrival
            done = len(job.items) - len(job.remaining)
            job.answer(
                None,
                DeadlineExceeded(
                    f"the request passed its deadline after {waited:.3f} s "
                    f"({done} of {len(job.items)} items computed)"
                ),
            )

    def _choose(self, jobs: list[EncoderJob], budget: int) -> list[tuple[EncoderJob, int]]:
        """The next micro-batch's (job, item index) members from `jobs` within `budget` padded
        tokens, taken off the jobs' remaining (under the lock)."""
        members: list[tuple[EncoderJob, int]] = []
        longest = 0
        for job in sorted(jobs, key=EncoderJob.key):
            if members and job.priority != members[0][0].priority:
                break  # worse items would only slow the better job's micro-batch
            taken = []
            for index in job.remaining:
                length = job.lengths[index]
                size = len(members) + len(taken) + 1
                if size > self.max_batch_size:
                    break
                if (members or taken) and size * max(longest, length) > budget:
                    continue  # a shorter item of this job may still fit
                taken.append(index)
                longest = max(longest, length)
            if taken:
                chosen = set(taken)
                job.remaining = [i for i in job.remaining if i not in chosen]
                job.in_flight += len(taken)
                members += [(job, i) for i in taken]
            if len(members) >= self.max_batch_size:
                break
        return members

    def _fail(self, jobs: set[EncoderJob], exc: Exception) -> None:
        error = RuntimeError(f"encoder forward failed: {type(exc).__name__}: {exc}")
        with self._cond:
            self._jobs = [job for job in self._jobs if job not in jobs]
            self._cond.notify_all()
        for job in sorted(jobs, key=EncoderJob.key):
            job.answer(None, error)


def _store(job: EncoderJob, index: int, value: Any) -> None:
    """Put one item's computed value in its job's values (an array for array rows, else a
    list)."""
    if job.values is None:
        if isinstance(value, np.ndarray):
            job.values = np.empty((len(job.items), *value.shape), dtype=value.dtype)
        else:
            job.values = [None] * len(job.items)
    job.values[index] = value


def _merged(reports: Sequence[MicroBatch]) -> MicroBatch:
    """One report for a micro-batch the compute ran as several (a bi-encoder reranker embeds a
    pair's two texts apart, so its pairs' texts may not fit one of the embedder's batches)."""
    return MicroBatch(
        indices=[i for r in reports for i in r.indices],
        padded_tokens=sum(r.padded_tokens for r in reports),
        real_tokens=sum(r.real_tokens for r in reports),
        seconds=sum(r.seconds for r in reports),
    )
