"""The per-tenant and per-priority series (serving/tenant_metrics.py) on a real
prometheus_client registry: the default tenant's from load at 0, gauges that follow the
scheduler (and drop to 0 when a tenant has nothing left), token counts that add up, time to
first token per tenant and per priority, and a label set bounded by max_tenant_labels."""

from __future__ import annotations

from prometheus_client import generate_latest

from backend_lib.llm.core.stats import EngineCounters, EngineStats, FinishedRequest
from backend_lib.llm.serving.metrics import EXTRA_LABELS, LLMMetrics
from backend_lib.llm.serving.tenant_metrics import OTHER
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text

LABELS = {"model": "llm", "version": "1", "model_name": "llm"}


def metrics(max_tenant_labels: int = 16) -> tuple[PrometheusMetrics, LLMMetrics]:
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    llm = LLMMetrics(
        sink.with_labels(model_name="llm"),
        max_model_len=64,
        block_size=16,
        num_blocks=8,
        max_tenant_labels=max_tenant_labels,
    )
    return sink, llm


def scrape(sink) -> dict:
    return parse_prometheus_text(generate_latest(sink.registry).decode())


def series(scraped: dict, name: str, label: str) -> dict[str, float]:
    """label value -> sample value of `name`."""
    return {
        dict(labels)[label]: value
        for (metric, labels), value in scraped.items()
        if metric == name and set(LABELS.items()) <= labels
    }


def finished(tenant: str, priority: int, ttft: float) -> FinishedRequest:
    return FinishedRequest(
        "r", "stop", 4, 2, 1, 2, 1.0, 0.1, ttft, 0.1, 0.5, tenant=tenant, priority=priority
    )


def stats(**fields) -> EngineStats:
    return EngineStats(0, 0, 0, 0.0, EngineCounters(), **fields)


def test_the_default_tenant_s_series_exist_from_load_at_zero():
    sink, _ = metrics()
    scraped = scrape(sink)
    for name in ("llm_tenant_requests_running", "llm_tenant_requests_waiting"):
        assert series(scraped, name, "tenant") == {"default": 0}
    assert series(scraped, "llm_tenant_tokens_total", "tenant") == {"default": 0}
    assert series(scraped, "llm_tenant_time_to_first_token_seconds_count", "tenant") == {
        "default": 0
    }
    assert series(scraped, "llm_priority_time_to_first_token_seconds_count", "priority") == {"0": 0}


def test_gauges_counters_and_histograms_follow_the_snapshots():
    sink, llm = metrics()
    llm.update(
        stats(
            running_by_tenant={"acme": 3, "default": 1},
            waiting_by_tenant={"acme": 5},
            tokens_by_tenant={"acme": 40, "default": 7},
            finished=[finished("acme", -1, 0.03), finished("default", 0, 0.5)],
        )
    )
    llm.update(stats(running_by_tenant={"default": 2}, tokens_by_tenant={"acme": 2}))
    scraped = scrape(sink)
    assert series(scraped, "llm_tenant_requests_running", "tenant") == {"acme": 0, "default": 2}
    assert series(scraped, "llm_tenant_requests_waiting", "tenant") == {"acme": 0, "default": 0}
    assert series(scraped, "llm_tenant_tokens_total", "tenant") == {"acme": 42, "default": 7}
    counts = series(scraped, "llm_tenant_time_to_first_token_seconds_count", "tenant")
    assert counts == {"acme": 1, "default": 1}
    by_priority = series(scraped, "llm_priority_time_to_first_token_seconds_sum", "priority")
    assert by_priority == {"-1": 0.03, "0": 0.5}


def test_tenants_past_the_limit_are_counted_as_other():
    sink, llm = metrics(max_tenant_labels=2)  # "default" takes the first label
    llm.update(
        stats(
            running_by_tenant={"a": 1, "b": 2, "c": 4},
            tokens_by_tenant={"a": 1, "b": 10, "c": 100},
            finished=[finished("b", p, 0.1) for p in (1, 2, 3)],
        )
    )
    scraped = scrape(sink)
    assert series(scraped, "llm_tenant_requests_running", "tenant") == {
        "default": 0,
        "a": 1,
        OTHER: 6,
    }
    assert series(scraped, "llm_tenant_tokens_total", "tenant") == {
        "default": 0,
        "a": 1,
        OTHER: 110,
    }
    priorities = series(scraped, "llm_priority_time_to_first_token_seconds_count", "priority")
    assert priorities == {"0": 0, "1": 1, OTHER: 2}
