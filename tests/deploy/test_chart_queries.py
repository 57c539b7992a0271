"""Every PromQL expression the chart ships (PrometheusRule, prometheus-adapter rules with their
templates filled in as the adapter does, KEDA triggers) parses, and reads only metrics that exist:
the backend's (collected from backend_lib), Triton's own (tests/deploy/triton_metric_names.py,
checked against a real server end to end), `up`, and the chart's own recording rules."""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml

from tests.deploy.chart import EVERYTHING_ON, KEDA, NAMESPACE, by_kind, render
from tests.deploy.exported_metrics import backend_metric_names
from tests.deploy.triton_metric_names import (
    PROMETHEUS_SYNTHETIC,
    TRITON_CPU_METRICS,
    TRITON_GPU_METRICS,
)

ADAPTER_MATCHERS = f'namespace="{NAMESPACE}",pod=~"rel-triton-llm-llm-abc|rel-triton-llm-llm-def"'


def adapter_queries(objects: list[dict]) -> list[str]:
    """Each rule's seriesQuery and its metricsQuery, `<<.Series>>`, `<<.LabelMatchers>>` and
    `<<.GroupBy>>` substituted as prometheus-adapter does for a per-pod request."""
    (configmap,) = by_kind(objects, "ConfigMap").values()
    rules = yaml.safe_load(configmap["data"]["config.yaml"])["rules"]
    queries = []
    for rule in rules:
        series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
        assert re.fullmatch(rule["name"]["matches"], series)
        filled = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", ADAPTER_MATCHERS)
            .replace("<<.GroupBy>>", "pod")
        )
        assert "<<" not in filled, filled
        queries += [rule["seriesQuery"], filled]
    return queries


def rule_queries(objects: list[dict]) -> tuple[list[str], set[str]]:
    """The PrometheusRule's expressions and the names its recording rules define."""
    (rule,) = by_kind(objects, "PrometheusRule").values()
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    return [r["expr"] for r in rules], {r["record"] for r in rules if "record" in r}


def keda_queries() -> list[str]:
    objects = render("values-gpu.yaml", KEDA)
    return [
        trigger["metadata"]["query"]
        for scaled in by_kind(objects, "ScaledObject").values()
        for trigger in scaled["spec"]["triggers"]
    ]


def all_queries() -> tuple[list[str], set[str]]:
    objects = render("values-gpu.yaml", EVERYTHING_ON)
    rules, recorded = rule_queries(objects)
    return adapter_queries(objects) + rules + keda_queries(), recorded


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


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
