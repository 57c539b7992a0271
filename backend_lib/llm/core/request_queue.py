"""The order the scheduler serves sequences in (`scheduling_policy`, vLLM's name and semantics).

- "fcfs": the waiting and swapped queues are first come, first served, a preempted sequence going
  back to their front; running sequences are scheduled in admission order, and the one admitted
  last is the first preemption victim.
- "priority": every queue, and the running list, is kept sorted by `Order.key`: lower priority
  values first (the request's `priority`, default 0), then earlier arrivals. So the waiting
  sequence of lowest value is admitted first (a preempted one takes its place by key, not at the
  front), the running ones of lowest value get their prefill chunks and decodes into the step's
  token budget first, and the running one of highest value is the first preemption victim.

Aging (`priority_aging_rate`, priority levels per second; 0, the default, is vLLM's strict
order): a sequence's effective priority is `priority - rate * (now - arrival_time)`. Since `now`
is the same for every sequence, the order is that of `priority + rate * arrival_time`, a key that
never changes while a sequence waits, so the queues stay sorted without re-keying. A request of
priority p waiting beside a stream of new requests of priority q < p is ahead of every one that
arrives more than (p - q) / rate seconds after it: it waits at most that long plus the time for a
slot (a running sequence finishing, or its own turn among older ones) to free.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator

from backend_lib.llm.core.sequence import Sequence

POLICIES = ("fcfs", "priority")


class PriorityQueue:
    """Sequences sorted by `Order.key`, with a deque's interface as the scheduler uses it:
    `append` and `appendleft` both insert by key; `[0]` and `popleft` give the lowest key."""

    def __init__(self, order: Order) -> None:
        self._order = order
        self._seqs: list[Sequence] = []

    def append(self, seq: Sequence) -> None:
        bisect.insort(self._seqs, seq, key=self._order.key)

    appendleft = append  # a preempted sequence goes where its key puts it

    def popleft(self) -> Sequence:
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def __getitem__(self, index: int) -> Sequence:
        return self._seqs[index]

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)


class Order:
    """One scheduler's policy: its queues, and where an admitted sequence goes among the running."""

    def __init__(self, policy: str, aging_rate: float = 0.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling_policy {policy!r}: expected one of {POLICIES}")
        self.by_priority = policy == "priority"
        self.aging_rate = aging_rate

    def key(self, seq: Sequence) -> tuple[float, float, int]:
        """Lower first: (priority + aging_rate * arrival_time, arrival_time, seq_id); a forked
        child (same request, later id) comes right after its parent."""
        return (seq.priority + self.aging_rate * seq.arrival_time, seq.arrival_time, seq.seq_id)

    def queue(self) -> deque[Sequence] | PriorityQueue:
        """An empty waiting (or swapped) queue."""
        return PriorityQueue(self) if self.by_priority else deque()

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Under priority, whether `seq`'s effective priority is strictly lower (better) than
        `other`'s: only then may it displace `other` from a running slot, or be admitted while
        `other` waits swapped. Never under fcfs; never between equal priorities (their order is
        arrival)."""
        return self.by_priority and self.key(seq)[0] < self.key(other)[0]

    def goes_first(self, queue: Iterable[Sequence], other: Iterable[Sequence]) -> bool:
        """Whether the head of `queue` outranks the head of `other` (both non-empty)."""
        first, rival = next(iter(queue), None), next(iter(other), None)
        return first is not None and rival is not None and self.outranks(first, rival)

    def add_running(self, running: list[Sequence], seq: Sequence) -> None:
        """Put a newly running sequence in its place: last under fcfs (the newest is the first
        victim), by key under priority (the highest key is last, so the first victim)."""
        if self.by_priority:
            bisect.insort(running, seq, key=self.key)
        else:
            running.append(seq)
