"""Request deadlines and the queue-wait limit, enforced at step boundaries.

A request may carry a deadline (`EngineRequest.deadline`, seconds on `time.monotonic()`): the
serving layer sets it from Triton's request timeout or the `deadline_ms` sampling parameter. At
the start of every step, a request past its deadline ends with DEADLINE_EXCEEDED: one still
waiting (queued, held for its grammar) is dropped, one admitted is aborted; its KV blocks are
freed either way and the other requests' tokens are untouched. With `max_queue_wait_ms`, a request
not admitted within that long ends with QUEUE_TIMEOUT (answered 503 with Retry-After, as SGLang's
queue timeout). A request thus ends at most one step after it is due.

Due times sit in one heap, so a step pays nothing while none is due; `next_due` tells the driving
thread how long it may sleep (serving/engine_loop.py). A finished request's entries stay until
they fall due (then dropped, at the cost of one wake of the loop), rather than being searched for
at every finish.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from backend_lib.contract import ErrorCode
from backend_lib.llm.core.request import EngineRequest


@dataclass(order=True)
class Due:
    """A time at which a request must have finished (`deadline`) or been admitted
    (`queue_wait`)."""

    when: float
    """Seconds on time.monotonic()."""
    request_id: str = field(compare=False)
    kind: str = field(compare=False)
    """"deadline" or "queue_wait"."""
    arrival_time: float = field(compare=False)


@dataclass(frozen=True)
class Expired:
    """A request to end now, and how its client is told."""

    request_id: str
    code: ErrorCode
    message: str


class Deadlines:
    """The due times of one engine's requests."""

    def __init__(self, max_queue_wait_ms: int = 0) -> None:
        self.max_queue_wait_s = max_queue_wait_ms / 1000 if max_queue_wait_ms > 0 else None
        self._heap: list[Due] = []

    def watch(self, request: EngineRequest) -> None:
        """Track a request as it is queued (its `arrival_time` set)."""
        arrival = request.arrival_time
        if request.deadline is not None:
            heapq.heappush(
                self._heap, Due(request.deadline, request.request_id, "deadline", arrival)
            )
        if self.max_queue_wait_s is not None:
            when = arrival + self.max_queue_wait_s
            heapq.heappush(self._heap, Due(when, request.request_id, "queue_wait", arrival))

    def next_due(self) -> float | None:
        """The earliest due time still tracked (None: none); it may be of a finished request."""
        return self._heap[0].when if self._heap else None

    def expire(self, now: float, admitted: Callable[[str, float], bool | None]) -> list[Expired]:
        """The requests to end at `now`. `admitted(request_id, arrival_time)`: whether the
        unfinished request of that id and arrival was ever scheduled; None when there is none (it
        finished, or its id now names a later request): its due times are then dropped here."""
        expired: dict[str, Expired] = {}
        while self._heap and self._heap[0].when <= now:
            due = heapq.heappop(self._heap)
            state = admitted(due.request_id, due.arrival_time)
            if state is None or due.request_id in expired:
                continue  # finished meanwhile, or already ending
            waited_ms = (now - due.arrival_time) * 1000
            if due.kind == "deadline":
                phase = "running" if state else "waiting"
                limit_ms = (due.when - due.arrival_time) * 1000
                message = (
                    f"deadline exceeded: the request took {waited_ms:.0f} ms, past its deadline "
                    f"of {limit_ms:.0f} ms, while {phase}"
                    if limit_ms > 0
                    else "deadline exceeded: the deadline had passed when the request arrived"
                )
                expired[due.request_id] = Expired(
                    due.request_id, ErrorCode.DEADLINE_EXCEEDED, message
                )
            elif not state:
                message = (
                    f"queue wait limit exceeded: the request waited {waited_ms:.0f} ms for a "
                    f"batch slot (max_queue_wait_ms={self.max_queue_wait_s * 1000:.0f}); "
                    "retry later"
                )
                expired[due.request_id] = Expired(due.request_id, ErrorCode.QUEUE_TIMEOUT, message)
        return list(expired.values())
