"""The offload tier's series (kv_offloading_backend native), fed from `EngineStats.kv_offload`:

- vLLM's `vllm:external_prefix_cache_queries_total` and `vllm:external_prefix_cache_hits_total`
  (prompt tokens the device pool missed and looked up in the tier; of those, read back), and
  `vllm:kv_offload_total_bytes_total{transfer_type}` / `vllm:kv_offload_total_time_total`
  (transfer_type GPU_to_CPU: evicted blocks kept in RAM, CPU_to_GPU: tier hits loaded back, and
  ours CPU_to_DISK, DISK_to_CPU; the device pool is named GPU as in vLLM even on a CPU engine);
- per tier (`tier` ram or disk), in blocks: `llm_kv_offload_hits_total`,
  `llm_kv_offload_stores_total`, `llm_kv_offload_evictions_total`, `llm_kv_offload_errors_total`
  (failed writes; reads that were corrupt, truncated or missing), and the gauge
  `llm_kv_offload_usage_perc` (0-1).
Every series exists from load at 0.
"""

from __future__ import annotations

from backend_lib.llm.core.kv_offload import TierCounters
from backend_lib.llm.core.stats import KVOffloadStats
from backend_lib.metrics import MetricsSink

TIERS = ("ram", "disk")
TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU", "CPU_to_DISK", "DISK_to_CPU")
COUNTS = ("hits", "stores", "evictions", "errors")
LABELS = {
    "vllm:kv_offload_total_bytes_total": ("transfer_type",),
    **{f"llm_kv_offload_{count}_total": ("tier",) for count in COUNTS},
    "llm_kv_offload_usage_perc": ("tier",),
}
"""Their label names beyond the sink's constant ones (`PrometheusMetrics(extra_labels=)`)."""


class KVOffloadMetrics:
    """The tier's series of one llm model instance."""

    def __init__(self, sink: MetricsSink) -> None:
        self.external_queries = sink.counter(
            "vllm:external_prefix_cache_queries_total",
            "Prompt tokens looked up in the KV offload tier (missed by the device pool).",
        )
        self.external_hits = sink.counter(
            "vllm:external_prefix_cache_hits_total",
            "Prompt tokens read back from the KV offload tier instead of recomputed.",
        )
        self.bytes = sink.counter(
            "vllm:kv_offload_total_bytes_total", "Bytes moved by the KV offload tier."
        )
        self.seconds = sink.counter(
            "vllm:kv_offload_total_time_total",
            "Seconds the engine step spent copying blocks to and from the KV offload tier.",
        )
        self.counts = {
            count: sink.counter(
                f"llm_kv_offload_{count}_total", f"KV offload tier {count}, blocks."
            )
            for count in COUNTS
        }
        self.usage = sink.gauge(
            "llm_kv_offload_usage_perc", "Share of each KV offload tier in use, 0-1."
        )
        self._previous: KVOffloadStats | None = None
        for series in (self.external_queries, self.external_hits, self.seconds):
            series.touch()
        for transfer_type in TRANSFER_TYPES:
            self.bytes.touch(transfer_type=transfer_type)
        for tier in TIERS:
            for counter in self.counts.values():
                counter.touch(tier=tier)
            self.usage.set(0, tier=tier)

    def update(self, stats: KVOffloadStats) -> None:
        """Apply one snapshot (cumulative counts: the increments since the previous one)."""
        before = self._previous
        self._previous = stats
        _add(self.external_queries, stats.external_queries, before and before.external_queries)
        _add(self.external_hits, stats.external_hits, before and before.external_hits)
        _add(self.seconds, stats.copy_seconds, before and before.copy_seconds)
        for transfer_type, value in stats.bytes_moved.items():
            _add(
                self.bytes,
                value,
                before and before.bytes_moved.get(transfer_type),
                transfer_type=transfer_type,
            )
        for tier in TIERS:
            now: TierCounters = getattr(stats, tier)
            was = getattr(before, tier) if before else None
            for count, counter in self.counts.items():
                _add(counter, getattr(now, count), was and getattr(was, count), tier=tier)
        self.usage.set(stats.ram_usage, tier="ram")
        self.usage.set(stats.disk_usage, tier="disk")


def _add(counter, now: float, before: float | None, **labels: str) -> None:
    amount = now - (before or 0)
    if amount > 0:
        counter.inc(amount, **labels)
