"""The Grafana dashboards (deploy/grafana) import as they are and query what exists: every panel uses
the `datasource` variable, every query, its variables filled in as Grafana fills them, parses and
reads only metrics the backend, the OpenAI frontend or Triton exports, each selector scoped to `$model`, `$version` and
`$namespace`, and every topic the deployment issue asks for has a panel. Whether each panel has data
on a real server is tests/deploy/test_queries_live.py's question."""

from __future__ import annotations

import copy
import json
import re

import promql_parser
import pytest

from tests.deploy.dashboards import (
    ALL,
    DASHBOARD_DIR,
    DASHBOARD_MODELS,
    PanelQuery,
    grafana_intervals,
    load,
    panel_queries,
    panels,
    substitute,
)
from tests.deploy.exported_metrics import backend_metric_names, frontend_metric_names
from tests.deploy.promql import functions, metric_names, nodes
from tests.deploy.triton_metric_names import TRITON_CPU_METRICS

# GPU metrics carry no model label, and a CPU server exports none: no per-model panel may read them.
KNOWN_METRICS = backend_metric_names() | frontend_metric_names() | TRITON_CPU_METRICS
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Distinct values, so that a selector missing a matcher, or matching the wrong variable, shows.
SCOPE = {"model": "the-model", "version": "the-version", "namespace": "the-namespace"}
INTERVAL, RATE_INTERVAL = grafana_intervals(3600, 1000, 15)

TRITON_TOPICS = {
    "Triton success/failure": {"nv_inference_request_success", "nv_inference_request_failure"},
}
TOPICS = {
    "llm.json": {
        "TTFT": {"vllm:time_to_first_token_seconds_bucket"},
        "inter-token latency": {"vllm:inter_token_latency_seconds_bucket"},
        "e2e latency": {"vllm:e2e_request_latency_seconds_bucket"},
        "tokens/s": {"vllm:prompt_tokens_total", "vllm:generation_tokens_total"},
        "running/waiting": {"vllm:num_requests_running", "vllm:num_requests_waiting"},
        "KV usage": {"vllm:kv_cache_usage_perc"},
        "prefix-cache hit rate": {
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        },
        "preemptions": {"vllm:num_preemptions_total"},
        "finish reasons": {"vllm:request_success_total"},
        "TTFT per tenant": {"llm_tenant_time_to_first_token_seconds_bucket"},
        "TTFT per priority": {"llm_priority_time_to_first_token_seconds_bucket"},
        "tokens per tenant": {"llm_tenant_tokens_total"},
        "running/waiting per tenant": {
            "llm_tenant_requests_running",
            "llm_tenant_requests_waiting",
        },
        "crashed stub": {"nv_inference_request_failure", "vllm:generation_tokens_total"},
        "KV offload tier hit rate": {
            "vllm:external_prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total",
        },
        "KV offload tier traffic": {"vllm:kv_offload_total_bytes_total"},
        "KV offload tier usage": {"llm_kv_offload_usage_perc"},
        "KV offload tier errors": {"llm_kv_offload_errors_total", "llm_kv_offload_evictions_total"},
        **TRITON_TOPICS,
    },
    "encoders.json": {
        "batch size": {"encoder_batch_size_bucket"},
        "batch requests": {"encoder_batch_requests_bucket"},
        "queue time": {"encoder_queue_seconds_bucket", "encoder_queue_seconds_sum"},
        "compute time": {"encoder_compute_seconds_bucket", "encoder_compute_seconds_sum"},
        "crashed stub": {"nv_inference_request_failure", "encoder_items_total"},
        **TRITON_TOPICS,
    },
    "versions.json": {
        "TTFT": {"vllm:time_to_first_token_seconds_bucket"},
        "inter-token latency": {"vllm:inter_token_latency_seconds_bucket"},
        "tokens/s": {"vllm:generation_tokens_total"},
        "error rate": {"openai_frontend_model_requests_total"},
        "request share vs split": {
            "openai_frontend_model_requests_total",
            "openai_frontend_split_weight",
        },
        "rerouted": {"openai_frontend_split_rerouted_total"},
        "frontend latency": {"openai_frontend_model_request_duration_seconds_bucket"},
    },
}
"""Per dashboard, each topic's metric names, all read by one panel."""


def fill(expr: str) -> str:
    return substitute(expr, **SCOPE, interval=INTERVAL, rate_interval=RATE_INTERVAL)


def selector_problems(selector: promql_parser.VectorSelector) -> list[str]:
    """A selector must read a known metric of the dashboard's model, version and namespace."""
    problems = [] if selector.name in KNOWN_METRICS else [f"unknown metric {selector.name}"]
    matchers = {m.name: m.value for m in selector.matchers.matchers}
    # substitute() escapes a non-All version or namespace; SCOPE's values have nothing to escape.
    wrong = {label for label, value in SCOPE.items() if matchers.get(label) != value}
    if wrong:
        problems.append(f"{selector.name} not scoped by {sorted(wrong)}")
    return problems


def query_problems(query: PanelQuery) -> list[str]:
    """Filled in as Grafana fills it, the query parses and reads known, scoped metrics."""
    where = f"{query.title} [{query.ref_id}]"
    problems = []
    if re.search(r"\[\s*\d", query.expr):  # a fixed range ignores the scrape interval
        problems.append(f"{where}: a fixed range instead of $__rate_interval")
    expr = fill(query.expr)
    if "$" in expr or "[[" in expr:
        return problems + [f"{where}: a variable left after substitution: {expr}"]
    try:
        selectors = nodes(expr, promql_parser.VectorSelector)
    except ValueError as error:
        return problems + [f"{where}: does not parse ({error}): {expr}"]
    problems += [f"{where}: {p}" for s in selectors for p in selector_problems(s)]
    buckets = any(name.endswith("_bucket") for name in metric_names(expr))
    if buckets and "histogram_quantile" not in functions(expr):
        problems.append(f"{where}: reads buckets without histogram_quantile")
    return problems


def panel_problems(panel: dict) -> list[str]:
    """Importable as is: the datasource variable everywhere, a unit, named series."""
    where = panel.get("title", f"panel {panel.get('id')}")
    problems = []
    targets = panel.get("targets", [])
    if not targets:
        problems.append(f"{where}: no queries")
    if panel.get("datasource") != DATASOURCE or any(
        t.get("datasource") != DATASOURCE for t in targets
    ):
        problems.append(f"{where}: not on the ${{datasource}} variable")
    if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
        problems.append(f"{where}: no unit")
    if not panel.get("description"):
        problems.append(f"{where}: no description")
    problems += [f"{where} [{t['refId']}]: no legend" for t in targets if not t.get("legendFormat")]
    return problems


def variable_problems(dashboard: dict) -> list[str]:
    """The data source, namespace, model and version variables the queries rely on."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables.get("datasource", {})
    problems = []
    if (source.get("type"), source.get("query")) != ("datasource", "prometheus"):
        problems.append("no `datasource` variable of Prometheus data sources")
    for name, include_all in (("namespace", True), ("model", False), ("version", True)):
        variable = variables.get(name)
        if variable is None:
            problems.append(f"no `{name}` variable")
            continue
        if variable.get("datasource") != DATASOURCE:
            problems.append(f"`{name}` not on the ${{datasource}} variable")
        if f", {name})" not in variable.get("definition", ""):
            problems.append(f"`{name}` does not list {name} label values")
        if bool(variable.get("includeAll")) != include_all or variable.get("multi"):
            problems.append(f"`{name}`: includeAll should be {include_all}, single value")
        if include_all and variable.get("allValue") != ALL:
            problems.append(f"`{name}`: allValue should be {ALL}, to match a missing label too")
    return problems


def dashboard_problems(dashboard: dict) -> list[str]:
    """Everything the static checks find wrong with a dashboard (empty: none)."""
    problems = variable_problems(dashboard)
    if not dashboard.get("uid") or dashboard.get("schemaVersion", 0) < 39:
        problems.append("no uid, or a schemaVersion older than Grafana 10's")
    ids = [p["id"] for p in dashboard["panels"] if p.get("type") == "row"] + [
        p["id"] for p in panels(dashboard)
    ]
    if len(ids) != len(set(ids)):
        problems.append(f"duplicate panel ids: {sorted(i for i in set(ids) if ids.count(i) > 1)}")
    for panel in panels(dashboard):
        problems += panel_problems(panel)
    for query in panel_queries(dashboard):
        problems += query_problems(query)
    return problems


def names_by_panel(dashboard: dict) -> dict[str, set[str]]:
    """The metric names each panel reads, by panel title."""
    return {
        panel["title"]: set().union(*(metric_names(fill(t["expr"])) for t in panel["targets"]))
        for panel in panels(dashboard)
    }


def test_the_dashboards_are_the_files_in_deploy_grafana():
    assert sorted(p.name for p in DASHBOARD_DIR.glob("*.json")) == sorted(DASHBOARD_MODELS)
    assert sorted(TOPICS) == sorted(DASHBOARD_MODELS)


def test_every_dashboard_loads_with_its_own_uid():
    uids = [load(name)["uid"] for name in DASHBOARD_MODELS]
    assert all(uids) and len(set(uids)) == len(uids)


@pytest.mark.parametrize("name", sorted(DASHBOARD_MODELS))
def test_a_dashboard_has_no_problems(name):
    dashboard = load(name)
    assert len(panel_queries(dashboard)) >= 10
    assert dashboard_problems(dashboard) == []


@pytest.mark.parametrize("name", sorted(DASHBOARD_MODELS))
def test_every_topic_has_a_panel(name):
    read = names_by_panel(load(name)).values()
    missing = [topic for topic, names in TOPICS[name].items() if not any(names <= r for r in read)]
    assert missing == []


def test_finish_reasons_and_failures_are_split_by_their_reason_label():
    queries = panel_queries(load("llm.json")) + panel_queries(load("encoders.json"))
    for metric, label in (
        ("vllm:request_success_total", "finished_reason"),
        ("encoder_failures_total", "reason"),
    ):
        # The panel charting the metric by its label (others select one value, e.g. the stub panels'
        # reason="invalid_input").
        (query,) = [q for q in queries if metric in q.expr and f'{label}="' not in q.expr]
        assert f"by (version, {label})" in query.expr, query


def test_the_versions_dashboard_shows_every_version_side_by_side():
    """Every query of the A/B dashboard keeps the versions apart (its series are per version), and
    its error rates count 5xx and 4xx separately, a version without errors showing 0."""
    dashboard = load("versions.json")
    for panel in panels(dashboard):
        for target in panel["targets"]:
            assert "{{version}}" in target["legendFormat"], (panel["title"], target["refId"])
    queries = panel_queries(dashboard)
    for query in queries:
        assert re.search(r"by \((le, )?version\b", query.expr), query
    errors = [q.expr for q in queries if 'status=~"' in q.expr]
    assert {re.search(r'status=~"(.)\.\."', e).group(1) for e in errors} == {"4", "5"}
    assert all(" or 0 * sum by (version) (" in e for e in errors)


BROKEN = {
    "unknown metric": ("(version) (vllm:num_requests_running{", "(version) (vllm:no_such{"),
    "fixed range": ("[$__rate_interval]", "[5m]"),
    "not scoped by ['model']": ('model="$model",', ""),
    "variable left": ('version=~"$version"', 'version=~"$versions"'),
    "does not parse": ("sum by (version) (", "sum by (version) ((("),
    "not on the ${datasource} variable": ('"uid": "${datasource}"', '"uid": "prometheus"'),
    "no unit": ('"unit": "short"', '"unit": ""'),
    "duplicate panel ids": ('"id": 3,', '"id": 2,'),
}


@pytest.mark.parametrize("expected", sorted(BROKEN))
def test_the_check_catches_a_broken_dashboard(expected):
    old, new = BROKEN[expected]
    text = json.dumps(load("llm.json"), indent=2)
    if old not in text:  # a piece of an expression: its quotes are escaped in the JSON text
        old, new = json.dumps(old)[1:-1], json.dumps(new)[1:-1]
    assert old in text
    broken = json.loads(text.replace(old, new, 1))
    assert any(expected in problem for problem in dashboard_problems(broken))


def test_the_check_catches_a_missing_variable():
    dashboard = copy.deepcopy(load("encoders.json"))
    dashboard["templating"]["list"] = [
        v for v in dashboard["templating"]["list"] if v["name"] != "version"
    ]
    assert "no `version` variable" in dashboard_problems(dashboard)


@pytest.mark.parametrize(
    ("range_s", "points", "scrape_s", "interval", "rate_interval"),
    [
        (3600, 1000, 15, "15s", "1m0s"),  # 3.6s a point: the scrape interval, 4 scrapes
        (6 * 3600, 1000, 15, "20s", "1m0s"),  # 21.6s rounds to 20s; 20s + 15s < 4 x 15s
        (24 * 3600, 1000, 15, "1m", "1m15s"),  # 86.4s rounds to 1m; 1m + 15s
        (7 * 86400, 1000, 15, "10m", "10m15s"),
        (3600, 1000, 30, "30s", "2m0s"),
        (23, 1000, 1, "1s", "4s"),  # the live test's window
        (17.5 * 1000, 1000, 1, "15s", "21s"),  # at a rounding limit, the backend rounds down
    ],
)
def test_grafana_intervals(range_s, points, scrape_s, interval, rate_interval):
    assert grafana_intervals(range_s, points, scrape_s) == (interval, rate_interval)


def test_substitute_fills_every_syntax_and_escapes_as_grafana_does():
    expr = 'x{model="$model",m="${model}",v=~"$version",n=~"[[namespace]]"}[$__rate_interval] $__interval'
    filled = substitute(expr, model="llm", interval="15s", rate_interval="1m0s")
    assert filled == 'x{model="llm",m="llm",v=~".*",n=~".*"}[1m0s] 15s'
    # A chosen version or namespace is regex-escaped (it goes in =~), the model is not.
    filled = substitute(
        '{model="$model",v=~"$version",n=~"$namespace"}',
        model="a.b",
        version="1",
        namespace="team.prod",
        interval="15s",
        rate_interval="1m0s",
    )
    assert filled == r'{model="a.b",v=~"1",n=~"team\\.prod"}'
    assert substitute("$model_name $other", model="llm", interval="", rate_interval="") == (
        "$model_name $other"
    )


def test_panel_queries_walks_collapsed_rows_and_skips_hidden_targets():
    target = {"refId": "A", "expr": "up"}
    dashboard = {
        "panels": [
            {
                "type": "row",
                "collapsed": True,
                "panels": [{"title": "in row", "targets": [target]}],
            },
            {"title": "top", "targets": [target, {"refId": "B", "expr": "x", "hide": True}]},
        ]
    }
    assert panel_queries(dashboard) == [
        PanelQuery("in row", "A", "up"),
        PanelQuery("top", "A", "up"),
    ]
