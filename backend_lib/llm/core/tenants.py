"""Tenants: who each request is served for, their weights, their shares and their limits
(`fair_share`, `tenant_weights`, `max_running_per_tenant`, `max_queued_per_tenant`).

A sequence's tenant is its request's `tenant` (the frontend passes the API key's name or the
request's `user`), else its LoRA adapter's name, else "default" (`EngineRequest.tenant_key`).

Shares of tokens. Tenant t has a weight w_t (the `tenant_weights` file; 1 when not listed) and a
virtual time v_t: the tokens computed for it (prefill chunks and decodes, charged when each step is
computed) divided by w_t. Admission takes the waiting head of the tenant of least v_t (after
effective priority under `scheduling_policy: priority`, and after taking first the tenants under
their share of slots, below), so while tenants have demand their tokens grow in proportion to
their weights. A tenant that had no sequences starts at
max(v_t, the least v of the tenants that have some): idle time earns no credit, so a tenant coming
back cannot then hold the engine for as long as it was away (start-time fair queueing; CFS's
vruntime floor).

Shares of slots. A tenant with demand is entitled to max(1, floor(max_num_seqs * w_t / W)) running
sequences, W the weights of the tenants with demand. When the head waiting sequence's tenant is
under its entitlement and lacks a slot or the blocks for its first chunk, the newest running
sequence of the tenant furthest over its entitlement (running / weight) is preempted (the
scheduler's step 0). So a flood by one tenant cannot hold every slot while another waits; and as a
tenant at or under its entitlement is never a victim, tenants never preempt each other back and
forth.

Limits. A tenant with `max_running_per_tenant` sequences running admits no more (its next ones
wait; the others' are admitted past them); one with `max_queued_per_tenant` requests waiting has
its next ones refused with queue_full (HTTP 429).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from backend_lib.config import ConfigError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sequence import Sequence

if TYPE_CHECKING:
    from backend_lib.llm.core.scheduler import ScheduledSequence


def read_tenant_weights(path: str | Path) -> dict[str, float]:
    """The `tenant_weights` file: a JSON object of tenant -> weight (a finite number > 0);
    ConfigError naming `tenant_weights` and what is wrong otherwise."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("tenant_weights", str(path), f"cannot read it as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("tenant_weights", str(path), "expected a JSON object tenant -> weight")
    weights = {}
    for tenant, weight in raw.items():
        if (
            not tenant
            or isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not (math.isfinite(weight) and weight > 0)
        ):
            raise ConfigError(
                "tenant_weights",
                str(path),
                f"tenant {tenant!r}: the weight must be a finite number > 0, got {weight!r}",
            )
        weights[tenant] = float(weight)
    return weights


def queue_full_reason(tenant: str, num_waiting: int, max_queued: int) -> str | None:
    """Why a new request of `tenant`, which has `num_waiting` requests waiting, is refused under
    `max_queued_per_tenant` = `max_queued` (None: it is not; 0 is no limit)."""
    if max_queued and num_waiting >= max_queued:
        return (
            f"queue full: tenant {tenant!r} has {num_waiting} requests waiting "
            f"(max_queued_per_tenant={max_queued})"
        )
    return None


class TenantLedger:
    """Per-tenant counts, virtual times and limits of one scheduler; see the module docstring."""

    def __init__(
        self,
        weights: Mapping[str, float],
        max_num_seqs: int,
        fair_share: bool = True,
        max_running: int = 0,
        max_queued: int = 0,
    ) -> None:
        self.weights = dict(weights)
        self.max_num_seqs = max_num_seqs
        self.fair_share = fair_share
        self.max_running = max_running
        """Most running sequences per tenant (0: no limit)."""
        self.max_queued = max_queued
        """Most waiting sequences per tenant (0: no limit)."""
        self._vtime: dict[str, float] = {}
        self._demand: Counter[str] = Counter()
        """Unfinished sequences (waiting, running or swapped) per tenant."""
        self._demand_weight = 0.0
        """The weights of the tenants in `_demand`."""
        self._running: Counter[str] = Counter()
        self._tokens: dict[str, int] = {}
        """Tokens computed per tenant since `take_tokens` (prefill chunks, decodes, drafts)."""

    @classmethod
    def of(cls, config: LLMConfig, weights: Mapping[str, float]) -> TenantLedger:
        return cls(
            weights,
            config.max_num_seqs,
            config.fair_share,
            config.max_running_per_tenant,
            config.max_queued_per_tenant,
        )

    @property
    def keeps_apart(self) -> bool:
        """Whether tenants queue apart (fair share or a per-tenant limit)."""
        return self.fair_share or self.max_running > 0 or self.max_queued > 0

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def vtime(self, tenant: str) -> float:
        """Tokens computed for the tenant over its weight (0 under fcfs-between-tenants)."""
        return self._vtime.get(tenant, 0.0) if self.fair_share else 0.0

    def has_demand(self, tenant: str) -> bool:
        """Whether the tenant has a sequence waiting, running or swapped."""
        return self._demand[tenant] > 0

    def running(self, tenant: str) -> int:
        return self._running[tenant]

    def running_counts(self) -> dict[str, int]:
        """Tenant -> running sequences (tenants with none left out)."""
        return dict(self._running)

    # --- lifecycle hooks (the scheduler calls them) --------------------------------------------

    def enter(self, seq: Sequence) -> None:
        """A new unfinished sequence (queued or forked)."""
        tenant = seq.tenant
        if self._demand[tenant] == 0 and self._demand:
            floor = min(self._vtime.get(t, 0.0) for t in self._demand)
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), floor)
        if self._demand[tenant] == 0:
            self._demand_weight += self.weight(tenant)
        self._demand[tenant] += 1

    def leave(self, seq: Sequence) -> None:
        """An unfinished sequence finished."""
        tenant = seq.tenant
        self._demand[tenant] -= 1
        if self._demand[tenant] > 0:
            return
        del self._demand[tenant]
        self._demand_weight -= self.weight(tenant)
        if not self._demand:
            self._demand_weight = 0.0  # no float residue
            self._vtime.clear()  # nobody has demand: a new epoch, all equal
        elif self._vtime.get(tenant, 0.0) <= min(self._vtime.get(t, 0.0) for t in self._demand):
            self._vtime.pop(tenant, None)  # it would be floored to the least on return anyway

    def started(self, seq: Sequence) -> None:
        self._running[seq.tenant] += 1

    def stopped(self, seq: Sequence) -> None:
        """A running sequence was preempted or finished."""
        tenant = seq.tenant
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]

    def charge(self, scheduled: Iterable[ScheduledSequence]) -> None:
        """Count a step's computed tokens per tenant, and under fair share add them to their
        tenants' virtual times."""
        for item in scheduled:
            tenant, tokens = item.seq.tenant, item.num_new_tokens
            self._tokens[tenant] = self._tokens.get(tenant, 0) + tokens
            # A tenant whose last sequence failed in the step has left: no time to keep.
            if self.fair_share and tenant in self._demand:
                self._vtime[tenant] = self._vtime.get(tenant, 0.0) + tokens / self.weight(tenant)

    def take_tokens(self) -> dict[str, int]:
        """Tokens computed per tenant since the previous call (for the metrics)."""
        tokens, self._tokens = self._tokens, {}
        return tokens

    # --- decisions -------------------------------------------------------------------------------

    def may_run(self, tenant: str) -> bool:
        """Whether the tenant is under `max_running` (always, without that limit)."""
        return not self.max_running or self._running[tenant] < self.max_running

    def queue_full(self, tenant: str, num_waiting: int) -> str | None:
        """Why a new request of the tenant, which has `num_waiting` waiting, is refused (None:
        it is not)."""
        return queue_full_reason(tenant, num_waiting, self.max_queued)

    def entitlement(self, tenant: str, joining: str | None = None) -> int:
        """Running sequences the tenant is entitled to while it has demand (and, if given, the
        tenant `joining` has too)."""
        newcomers = {tenant, joining} - {None} - self._demand.keys()
        total = self._demand_weight + sum(self.weight(t) for t in newcomers)
        return max(1, math.floor(self.max_num_seqs * self.weight(tenant) / total))

    def under_share(self, tenant: str) -> bool:
        """Under fair share, whether the tenant runs fewer sequences than its entitlement."""
        return self.fair_share and self._running[tenant] < self.entitlement(tenant)

    def over_share(self, tenant: str, joining: str | None = None) -> bool:
        """Under fair share, whether the tenant runs more sequences than its entitlement (once
        the tenant `joining`, if given, has demand too)."""
        return self.fair_share and self._running[tenant] > self.entitlement(tenant, joining)

    def victim_for(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """Under fair share, the running sequence `seq` may displace: when its tenant is under its
        entitlement, the newest running one of the tenant furthest over its own; else None."""
        if not self.under_share(seq.tenant):
            return None
        over = [t for t in self._running if self.over_share(t)]
        if not over:
            return None
        worst = max(over, key=lambda t: self._running[t] / self.weight(t))
        return next(s for s in reversed(running) if s.tenant == worst)
