"""The order the scheduler serves sequences in (`scheduling_policy`, vLLM's name and semantics).

- "fcfs": the waiting and swapped queues are first come, first served, a preempted sequence going
  back to their front; running sequences are scheduled in admission order, and the one admitted
  last is the first preemption victim.
- "priority": every queue, and the running list, is kept sorted by `Order.key`: lower priority
  values first (the request's `priority`, default 0), then earlier arrivals. So the waiting
  sequence of lowest value is admitted first (a preempted one takes its place by key, not at the
  front), the running ones of lowest value get their prefill chunks and decodes into the step's
  token budget first, and the running one of highest value is the first preemption victim. A
  step carries the prefill chunks of one `priority` class (`Order.outranked_prefills`).

Aging (`priority_aging_rate`, priority levels per second; 0, the default, is vLLM's strict
order): a sequence's effective priority is `priority - rate * (now - arrival_time)`. Since `now`
is the same for every sequence, the order is that of `priority + rate * arrival_time`, a key that
never changes while a sequence waits, so the queues stay sorted without re-keying. A request of
priority p waiting beside a stream of new requests of priority q < p is ahead of every one that
arrives more than (p - q) / rate seconds after it: it waits at most that long plus the time for a
slot (a running sequence finishing, or its own turn among older ones) to free.

Tenants (`fair_share`, or a per-tenant limit; core/tenants.py): the waiting queue is a
`TenantQueue`, one queue per tenant in the order above, whose head is that of the tenant admission
serves next; under fair share the running list and the queue heads are ordered by (effective
priority, the tenant's virtual time), then the key above.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend_lib.errors import TenantLimitError
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.core.tenants import TenantLedger

if TYPE_CHECKING:
    from backend_lib.llm.core.scheduler import ScheduledSequence

POLICIES = ("fcfs", "priority")


class FifoQueue(deque):
    """First come, first served; `appendleft` puts a preempted sequence back in front."""

    def head(self) -> Sequence | None:
        """The sequence taken next (None: empty)."""
        return self[0] if self else None


class PriorityQueue:
    """Sequences sorted by `Order.key`, with a deque's interface as the scheduler uses it:
    `append` and `appendleft` both insert by key; `[0]` and `popleft` give the lowest key."""

    def __init__(self, order: Order) -> None:
        self._order = order
        self._seqs: list[Sequence] = []

    def append(self, seq: Sequence) -> None:
        bisect.insort(self._seqs, seq, key=self._order.key)

    appendleft = append  # a preempted sequence goes where its key puts it

    def head(self) -> Sequence | None:
        """The sequence of lowest key (None: empty)."""
        return self._seqs[0] if self._seqs else None

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

    def __init__(self, policy: str, aging_rate: float, tenants: TenantLedger) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling_policy {policy!r}: expected one of {POLICIES}")
        self.by_priority = policy == "priority"
        self.aging_rate = aging_rate
        self.tenants = tenants
        """The scheduler's tenants; when kept apart, the waiting queue is a TenantQueue."""
        self._sorted_running = self.by_priority or tenants.fair_share

    def key(self, seq: Sequence) -> tuple[float, float, int]:
        """Lower first: (priority + aging_rate * arrival_time, arrival_time, seq_id); a forked
        child (same request, later id) comes right after its parent."""
        return (seq.priority + self.aging_rate * seq.arrival_time, seq.arrival_time, seq.seq_id)

    def rank(self, seq: Sequence) -> tuple[float, float]:
        """(effective priority under priority, its tenant's virtual time under fair share), each
        0 when not: lower is served first."""
        priority = self.key(seq)[0] if self.by_priority else 0.0
        return priority, self.tenants.vtime(seq.tenant)

    def admission_rank(self, seq: Sequence) -> tuple[float, bool, float]:
        """Lower is admitted first: (effective priority, not under its tenant's share of slots,
        its tenant's virtual time); the share term is False unless under fair share."""
        priority, vtime = self.rank(seq)
        return priority, not self.tenants.under_share(seq.tenant), vtime

    def running_key(self, seq: Sequence) -> tuple[tuple[float, float], tuple[float, float, int]]:
        return self.rank(seq), self.key(seq)

    def queue(self) -> FifoQueue | PriorityQueue:
        """An empty queue of one tenant, or the swapped queue."""
        return PriorityQueue(self) if self.by_priority else FifoQueue()

    def waiting_queue(self) -> FifoQueue | PriorityQueue | TenantQueue:
        """The empty waiting queue: split by tenant when tenants are kept apart."""
        if not self.tenants.keeps_apart:
            return self.queue()
        return TenantQueue(self, self.tenants)

    def victim_for(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """The running sequence the waiting `seq` may displace (the scheduler's step 0): the last
        one if `seq` outranks it by priority, else fair share's pick (core/tenants.py) unless that
        one outranks `seq`; None: none."""
        if not running:
            return None
        if self.outranks(seq, running[-1]):
            return running[-1]
        victim = self.tenants.victim_for(seq, running)
        return None if victim is None or self.outranks(victim, seq) else victim

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Under priority, whether `seq`'s effective priority is strictly lower (better) than
        `other`'s: only then may it displace `other` from a running slot, or be admitted while
        `other` waits swapped. Never under fcfs; never between equal priorities (their order is
        arrival)."""
        return self.by_priority and self.key(seq)[0] < self.key(other)[0]

    def outranked_prefills(self, running: list[Sequence], *queues: AnyQueue) -> list[Sequence]:
        """The running prefills that yield the step's budget (the scheduler's step 1): those the
        best head of `queues` outranks by `admission_rank` (under priority or fair share: they
        take the budget after admission), and under priority those of a worse `priority` class
        than the best prefill to come, running or queued (a step carries one class's prefill
        chunks, so a better request's first token is not held back by worse prompts). Decodes
        keep their token. The class is the request's `priority`, not its aged one: aging never
        splits a class."""
        if not self._sorted_running:
            return []
        prefills = [seq for seq in running if seq.num_uncomputed_tokens > 1]
        heads = [head for queue in queues if (head := queue.head()) is not None]
        if not prefills or (not heads and not self.by_priority):
            return []
        first = min((self.admission_rank(head) for head in heads), default=None)
        best_class = min(seq.priority for seq in prefills + heads)
        return [
            seq
            for seq in prefills
            if (first is not None and first < self.admission_rank(seq))
            or (self.by_priority and seq.priority > best_class)
        ]

    def step_work(self, scheduled: Iterable[ScheduledSequence], free_slots: int) -> StepWork:
        """What a step carries, as `outranks_step` weighs it (computed once per step);
        `free_slots`: running slots left (`max_num_seqs` less the running sequences)."""
        work = StepWork(free_slots=free_slots)
        for item in scheduled:
            seq = item.seq
            work.worst_key = max(work.worst_key, self.key(seq)[0])
            worst = work.tenant_worst.get(seq.tenant, seq.priority)
            work.tenant_worst[seq.tenant] = max(worst, seq.priority)
            if not item.is_decode:
                work.best_prefill_class = min(work.best_prefill_class, seq.priority)
                work.prefill_tenants.add(seq.tenant)
        return work

    def outranks_step(
        self, priority: int, tenant: str, arrival_time: float, work: StepWork
    ) -> bool:
        """Whether a request of this `priority`, `tenant` and `arrival_time`, arrived during a
        step carrying `work`, outranks that work so that the step yields to it
        (engine/step_interrupts.py): it would be admitted at the next step ahead of some of it,
        and no prefill of its own kind is in the step already (that one is served first anyway).
        Under priority: its aged priority is better than some of the step's, and the step
        carries no prefill of its class or better. Under fair share: its tenant is under its
        share of slots (and under `max_running_per_tenant`), has no prefill in the step, and
        either the step carries a sequence of no better priority of a tenant over its share
        (once the newcomer counts: it would be displaced), or the tenant had no request at all
        and a slot is free (an idle tenant joining; not a busy tenant's every request, which
        would drop steps at its own rate). Never under fcfs."""
        if not self.tenants.may_run(tenant):
            return False
        key = priority + self.aging_rate * arrival_time
        if self.by_priority and key < work.worst_key and priority < work.best_prefill_class:
            return True
        if not self.tenants.under_share(tenant) or tenant in work.prefill_tenants:
            return False
        displaces = any(
            self.tenants.over_share(other, joining=tenant)
            and not (self.by_priority and worst < priority)
            for other, worst in work.tenant_worst.items()
        )
        return displaces or (work.free_slots > 0 and not self.tenants.has_demand(tenant))

    def goes_first(self, queue: AnyQueue, other: AnyQueue) -> bool:
        """Whether the head of `queue` is served before the head of `other` (both non-empty): it
        has a strictly lower `rank` (never under plain fcfs, whose swapped queue goes first)."""
        first, rival = queue.head(), other.head()
        return first is not None and rival is not None and self.rank(first) < self.rank(rival)

    def add_running(self, running: list[Sequence], seq: Sequence) -> None:
        """Put a newly running sequence in its place: last under fcfs (the newest is the first
        victim), by `running_key` under priority or fair share (the highest is last, so the first
        victim)."""
        if self._sorted_running:
            bisect.insort(running, seq, key=self.running_key)
        else:
            running.append(seq)

    def sort_running(self, running: list[Sequence]) -> None:
        """Re-sort the running list at a step's start: under fair share the tenants' virtual
        times moved with the last step."""
        if self.tenants.fair_share:
            running.sort(key=self.running_key)


@dataclass
class StepWork:
    """A step's work as `Order.outranks_step` weighs an arrival against it."""

    worst_key: float = -math.inf
    """The highest aged priority (`Order.key`'s first term) among its sequences."""
    best_prefill_class: float = math.inf
    """The lowest `priority` among its prefill chunks (inf: none)."""
    prefill_tenants: set[str] = field(default_factory=set)
    """The tenants with a prefill chunk in it."""
    tenant_worst: dict[str, int] = field(default_factory=dict)
    """Tenant -> the highest `priority` among its sequences in it."""
    free_slots: int = 0
    """Running slots left for the next step to admit into."""


class TenantQueue:
    """Waiting sequences, one queue per tenant in the policy's order. `head` is the sequence
    admission takes next: of the tenants under `max_running_per_tenant`, the head of least
    `_admission_key`; `append`/`appendleft`/`remove` as the single queues (the scheduler takes
    the head with `head` and `remove`)."""

    def __init__(self, order: Order, tenants: TenantLedger) -> None:
        self._order, self._tenants = order, tenants
        self._queues: dict[str, FifoQueue | PriorityQueue] = {}
        self._len = 0

    def append(self, seq: Sequence) -> None:
        self._queue_of(seq).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        self._queue_of(seq).appendleft(seq)
        self._len += 1

    def remove(self, seq: Sequence) -> None:
        queue = self._queues[seq.tenant]
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[seq.tenant]

    def head(self) -> Sequence | None:
        heads = [q[0] for t, q in self._queues.items() if self._tenants.may_run(t)]
        return min(heads, key=self._admission_key, default=None)

    def _admission_key(self, seq: Sequence) -> tuple:
        """(`Order.admission_rank`, key): a tenant under its share of slots goes before one at or
        over it (fair share only)."""
        return *self._order.admission_rank(seq), self._order.key(seq)

    def count(self, tenant: str) -> int:
        """Sequences of `tenant` waiting."""
        queue = self._queues.get(tenant)
        return 0 if queue is None else len(queue)

    def check_room(self, tenant: str) -> None:
        """TenantLimitError when `tenant` has max_queued_per_tenant sequences waiting."""
        reason = self._tenants.queue_full(tenant, self.count(tenant))
        if reason is not None:
            raise TenantLimitError(reason)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for queue in list(self._queues.values()):
            yield from queue

    def _queue_of(self, seq: Sequence) -> FifoQueue | PriorityQueue:
        queue = self._queues.get(seq.tenant)
        if queue is None:
            queue = self._queues[seq.tenant] = self._order.queue()
        return queue


AnyQueue = FifoQueue | PriorityQueue | TenantQueue
