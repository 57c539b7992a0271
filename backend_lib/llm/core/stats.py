"""Engine statistics for vLLM-style metrics.

`LLMEngine.stats()` returns an `EngineStats` snapshot: gauges (current values), `counters`
(cumulative totals; subtract the previous snapshot's to get increments for Prometheus counters),
and the observations made since the previous call (latencies and finished-request records for
histograms), which the call drains.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from backend_lib.llm.core.kv_offload import TierCounters
from backend_lib.llm.core.request import DEFAULT_TENANT
from backend_lib.llm.core.scheduler import SchedulerStats

# Observations kept when no one drains them (an engine driven without a metrics consumer).
MAX_PENDING_OBSERVATIONS = 100_000


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative totals since the engine started."""

    prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token."""
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found there."""
    requests_finished: int = 0
    structured_output_requests: int = 0
    """Requests admitted with a structured_outputs constraint."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding: sequence-steps that verified at least one draft token."""
    spec_decode_num_draft_tokens: int = 0
    """Draft tokens verified."""
    spec_decode_num_accepted_tokens: int = 0
    """Of those, accepted."""
    steps_interrupted: int = 0
    """Steps dropped at a layer boundary for an arrival that outranked them
    (engine/step_interrupts.py)."""
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    """Accepted drafts by position in their run (index 0: first draft), as long as the longest
    run verified so far."""

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        """Increments since `other` (an earlier snapshot)."""
        return EngineCounters(
            *(
                _minus(getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)
            )
        )


def _minus(now: int | tuple[int, ...], before: int | tuple[int, ...]):
    """now - before; per position for tuples (the earlier one may be shorter)."""
    if isinstance(now, tuple):
        assert isinstance(before, tuple)
        return tuple(n - (before[i] if i < len(before) else 0) for i, n in enumerate(now))
    return now - before


@dataclass(frozen=True)
class FinishedRequest:
    """One finished request, for per-request histograms (latencies in seconds)."""

    request_id: str
    finish_reason: str
    """Of its first sequence ("stop", "length", "abort", "error")."""
    num_prompt_tokens: int
    num_generation_tokens: int
    """Over all n sequences."""
    n: int
    max_tokens: int | None
    e2e_latency: float
    """Arrival to finish."""
    queue_time: float | None
    """Arrival to first scheduled (None if never scheduled)."""
    time_to_first_token: float | None
    """Arrival to first output token (None if none was produced)."""
    prefill_time: float | None
    """First scheduled to first token."""
    decode_time: float | None
    """First token to last token."""
    tenant: str = DEFAULT_TENANT
    """Its tenant (`EngineRequest.tenant_key`), for the per-tenant series."""
    priority: int = 0
    """Its scheduling priority, for the per-priority series."""


@dataclass
class EngineStats:
    num_running: int
    """Running sequences (a request with n > 1 counts n once forked)."""
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    """Fraction of device KV blocks in use, 0-1."""
    counters: EngineCounters
    time_to_first_token: list[float] = field(default_factory=list)
    """Seconds, one per request that produced its first token since the previous snapshot."""
    inter_token_latency: list[float] = field(default_factory=list)
    """Seconds between consecutive tokens of a sequence, since the previous snapshot."""
    finished: list[FinishedRequest] = field(default_factory=list)
    """Requests finished since the previous snapshot."""
    grammar_compile_seconds: list[float] = field(default_factory=list)
    """Seconds, one per structured-output grammar compiled (cache misses) since the previous
    snapshot."""
    bitmask_fill_seconds: list[float] = field(default_factory=list)
    """Seconds, one per step with constrained rows: the worker's bitmask fill time."""
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Adapter name -> running sequences under it."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Adapter name -> waiting (or swapped) sequences under it."""
    lora_requests: list[str] = field(default_factory=list)
    """The adapter name of each request admitted with one since the previous snapshot."""
    num_waiting_for_grammar: int = 0
    """Of num_waiting, the requests held outside the scheduler while their grammar compiles."""
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    """Tenant -> running sequences."""
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    """Tenant -> sequences waiting for admission (in the scheduler)."""
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)
    """Tenant -> tokens computed for it since the previous snapshot."""
    kv_offload: KVOffloadStats | None = None
    """The offload tier's counts (None: no tier)."""


@dataclass(frozen=True)
class KVOffloadStats:
    """The offload tier's cumulative counts and its usage now (core/kv_offload.py)."""

    external_queries: int
    """Prompt tokens looked up in the tier (those the device pool missed), in tokens."""
    external_hits: int
    """Of those, read back from the tier instead of recomputed."""
    ram: TierCounters
    disk: TierCounters
    bytes_moved: dict[str, int]
    """Transfer type (GPU_to_CPU, CPU_to_GPU, CPU_to_DISK, DISK_to_CPU) -> bytes."""
    copy_seconds: float
    """Time the engine step spent on tier copies."""
    ram_usage: float
    """Fraction of the RAM tier's slots holding blocks, 0-1."""
    disk_usage: float
    """Fraction of the disk tier's size in files, 0-1 (0 without a disk tier)."""


class StatsCollector:
    """Accumulates what the engine observes; `snapshot` drains the observations."""

    def __init__(self, max_pending: int = MAX_PENDING_OBSERVATIONS) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.constrained_requests = 0
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_accepted_tokens_per_pos: list[int] = []
        self._grammar_compile: deque[float] = deque(maxlen=max_pending)
        self._bitmask_fill: deque[float] = deque(maxlen=max_pending)
        self._ttft: deque[float] = deque(maxlen=max_pending)
        self._itl: deque[float] = deque(maxlen=max_pending)
        self._finished: deque[FinishedRequest] = deque(maxlen=max_pending)
        self._lora_requests: deque[str] = deque(maxlen=max_pending)

    def first_token(self, time_to_first_token: float, num_prompt_tokens: int) -> None:
        self._ttft.append(time_to_first_token)
        self.prompt_tokens += num_prompt_tokens

    def tokens(self, num_tokens: int, inter_token_latencies: list[float]) -> None:
        self.generation_tokens += num_tokens
        self._itl.extend(inter_token_latencies)

    def grammar_compiled(self, seconds: float) -> None:
        """May be called from submitting threads (deque appends are atomic)."""
        self._grammar_compile.append(seconds)

    def bitmask_filled(self, seconds: float) -> None:
        self._bitmask_fill.append(seconds)

    def drafts_verified(self, runs: Iterable[tuple[int, int]]) -> None:
        """One step's (drafts, accepted) per sequence that verified drafts."""
        for num_drafts, num_accepted in runs:
            self.spec_decode_num_drafts += 1
            self.spec_decode_num_draft_tokens += num_drafts
            self.spec_decode_num_accepted_tokens += num_accepted
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            per_pos += [0] * (num_drafts - len(per_pos))
            for position in range(num_accepted):
                per_pos[position] += 1

    def lora_request(self, lora_name: str) -> None:
        """A request under adapter `lora_name` was admitted."""
        self._lora_requests.append(lora_name)

    def finished(self, record: FinishedRequest) -> None:
        self.requests_finished += 1
        self._finished.append(record)

    def snapshot(
        self, sched: SchedulerStats, tokens_by_tenant: dict[str, int] | None = None
    ) -> EngineStats:
        """The stats now; `tokens_by_tenant`: the scheduler's since the previous snapshot."""
        counters = EngineCounters(
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            requests_finished=self.requests_finished,
            structured_output_requests=self.constrained_requests,
            spec_decode_num_drafts=self.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(
                self.spec_decode_num_accepted_tokens_per_pos
            ),
        )
        stats = EngineStats(
            sched.num_running,
            sched.num_waiting,
            sched.num_swapped,
            sched.kv_usage,
            counters,
            list(self._ttft),
            list(self._itl),
            list(self._finished),
            _drain(self._grammar_compile),
            _drain(self._bitmask_fill),
            dict(sched.running_lora_adapters),
            dict(sched.waiting_lora_adapters),
            _drain(self._lora_requests),
            running_by_tenant=dict(sched.running_by_tenant),
            waiting_by_tenant=dict(sched.waiting_by_tenant),
            tokens_by_tenant=dict(tokens_by_tenant or {}),
        )
        self._ttft.clear()
        self._itl.clear()
        self._finished.clear()
        return stats


def _drain(values: deque) -> list:
    """Pop everything present now (appends from other threads meanwhile are kept for later)."""
    return [values.popleft() for _ in range(len(values))]
