"""Per-tenant and per-priority series of the llm model (no vLLM equivalent), fed from the same
engine snapshots as the vLLM-named ones (serving/metrics.py):

- `llm_tenant_requests_running{tenant}`, `llm_tenant_requests_waiting{tenant}`: sequences running
  and waiting for admission, per tenant (gauges);
- `llm_tenant_tokens_total{tenant}`: tokens computed for the tenant (prefill chunks, decodes,
  verified drafts): under `fair_share`, their rates divided by the weights should be about equal
  while the tenants have demand;
- `llm_tenant_time_to_first_token_seconds{tenant}` and
  `llm_priority_time_to_first_token_seconds{priority}`: time to first token of finished requests.

The label sets stay bounded (`max_tenant_labels`): the first N tenants (and priorities) seen keep
their own label, later ones are counted as `other`. The default tenant is "default".
"""

from __future__ import annotations

from backend_lib.llm.core.stats import EngineStats
from backend_lib.metrics import MetricsSink

OTHER = "other"
"""The label of the tenants (or priorities) past the first `max_tenant_labels`."""

LABELS = {
    "llm_tenant_requests_running": ("tenant",),
    "llm_tenant_requests_waiting": ("tenant",),
    "llm_tenant_tokens_total": ("tenant",),
    "llm_tenant_time_to_first_token_seconds": ("tenant",),
    "llm_priority_time_to_first_token_seconds": ("priority",),
}
"""Their label names beyond the sink's constant ones (`PrometheusMetrics(extra_labels=)`)."""


class BoundedLabel:
    """Maps values to labels: the first `limit` distinct values to themselves, the rest to
    OTHER."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: object) -> str:
        text = str(value)
        if text in self._seen:
            return text
        if len(self._seen) < self.limit and text != OTHER:
            self._seen.add(text)
            return text
        return OTHER


class TenantMetrics:
    """The per-tenant and per-priority series of one llm model instance."""

    def __init__(self, sink: MetricsSink, max_labels: int, ttft_buckets: tuple[float, ...]):
        self.tenant_label = BoundedLabel(max_labels)
        self.priority_label = BoundedLabel(max_labels)
        self.running = sink.gauge("llm_tenant_requests_running", "Sequences running, per tenant.")
        self.waiting = sink.gauge(
            "llm_tenant_requests_waiting", "Sequences waiting for admission, per tenant."
        )
        self.tokens = sink.counter(
            "llm_tenant_tokens_total", "Tokens computed (prefill and decode), per tenant."
        )
        self.ttft = sink.histogram(
            "llm_tenant_time_to_first_token_seconds",
            "Time to first token of finished requests, per tenant, seconds.",
            ttft_buckets,
        )
        self.priority_ttft = sink.histogram(
            "llm_priority_time_to_first_token_seconds",
            "Time to first token of finished requests, per priority, seconds.",
            ttft_buckets,
        )
        self._gauged: set[str] = set()
        """Labels whose gauges were set non-zero by the last update (zeroed when they go)."""
        default = self.tenant_label("default")
        for series in (self.running, self.waiting, self.tokens, self.ttft):
            series.touch(tenant=default)
        self.priority_ttft.touch(priority=self.priority_label(0))

    def update(self, stats: EngineStats) -> None:
        """Apply one engine snapshot."""
        gauged: set[str] = set()
        for gauge, counts in (
            (self.running, stats.running_by_tenant),
            (self.waiting, stats.waiting_by_tenant),
        ):
            per_label = self._per_label(counts)
            for label, value in per_label.items():
                gauge.set(value, tenant=label)
            for label in self._gauged - per_label.keys():
                gauge.set(0, tenant=label)
            gauged |= per_label.keys()
        self._gauged = gauged
        for tenant, tokens in stats.tokens_by_tenant.items():
            if tokens:
                self.tokens.inc(tokens, tenant=self.tenant_label(tenant))
        for record in stats.finished:
            if record.time_to_first_token is not None:
                self.ttft.observe(
                    record.time_to_first_token, tenant=self.tenant_label(record.tenant)
                )
                self.priority_ttft.observe(
                    record.time_to_first_token, priority=self.priority_label(record.priority)
                )

    def _per_label(self, counts: dict[str, int]) -> dict[str, int]:
        per_label: dict[str, int] = {}
        for tenant, count in counts.items():
            label = self.tenant_label(tenant)
            per_label[label] = per_label.get(label, 0) + count
        return per_label
