"""Every PromQL expression the chart ships (PrometheusRule, prometheus-adapter rules with their
templates filled in as the adapter does, KEDA triggers) parses, and reads only metrics that exist:
the backend's (collected from backend_lib), the OpenAI frontend's (from its registry), Triton's own (tests/deploy/triton_metric_names.py,
checked against a real server end to end), `up`, and the chart's own recording rules."""

from __future__ import annotations

import promql_parser
import pytest

from tests.deploy.chart import EVERYTHING_ON, NAMESPACE, render
from tests.deploy.chart_queries import adapter_rules, keda_queries, rule_queries
from tests.deploy.exported_metrics import backend_metric_names, frontend_metric_names
from tests.deploy.promql import metric_names
from tests.deploy.triton_metric_names import (
    PROMETHEUS_SYNTHETIC,
    TRITON_CPU_METRICS,
    TRITON_GPU_METRICS,
)

ADAPTER_MATCHERS = f'namespace="{NAMESPACE}",pod=~"rel-triton-llm-llm-abc|rel-triton-llm-llm-def"'


def all_queries() -> tuple[list[str], set[str]]:
    objects = render("values-gpu.yaml", EVERYTHING_ON)
    rules, recorded = rule_queries(objects)
    adapter = [
        query
        for rule in adapter_rules(objects)
        for query in (rule.series_query, rule.filled(ADAPTER_MATCHERS))
    ]
    keda = [query for queries in keda_queries().values() for query in queries]
    return adapter + rules + keda, recorded


def test_every_query_parses():
    queries, _ = all_queries()
    assert len(queries) >= 20
    for query in queries:
        promql_parser.parse(query)  # raises on a syntax error


def test_the_parser_rejects_a_broken_query():
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(vllm:num_preemptions_total[5m])")


def test_every_metric_a_query_reads_is_exported():
    queries, recorded = all_queries()
    known = (
        backend_metric_names()
        | frontend_metric_names()
        | TRITON_CPU_METRICS
        | TRITON_GPU_METRICS
        | PROMETHEUS_SYNTHETIC
        | recorded
    )
    used = set().union(*(metric_names(q) for q in queries))
    assert used - known == set()
    # The names the autoscaling and the alerts hinge on are among them.
    assert {
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:num_preemptions_total",
        "encoder_queue_seconds_sum",
        "encoder_queue_seconds_count",
        "nv_inference_request_failure",
        "up",
        "openai_frontend_model_requests_total",  # the A/B rollback signal
    } <= used


def test_backend_names_include_the_ecosystem_series():
    names = backend_metric_names()
    assert {
        "vllm:cache_config_info",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    } <= names
    assert "vllm:gpu_cache_usage_perc" not in names  # vLLM's old name; a query for it finds nothing
