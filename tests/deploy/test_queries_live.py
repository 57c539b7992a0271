"""A real Prometheus scrapes a real tritonserver serving the default repository, and the OpenAI
frontend in front of it (with a traffic split for llm), while a short mixed load runs (llm streams,
over gRPC and through the frontend by plain and pinned name, embedding and rerank calls), evaluating the chart's recording rules and
alerts. Then every PromQL expression the deployment ships is evaluated through Prometheus's HTTP API:
the Grafana dashboards' panels (template variables substituted as Grafana substitutes them, sent as
the range queries a panel sends), the recording rules and alerts, the prometheus-adapter queries
behind the HPAs, and the KEDA triggers. Each parses and evaluates, and each panel has data for every
model it is meant for."""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.deploy.chart import EVERYTHING_ON, NAMESPACE, render
from tests.deploy.chart_queries import adapter_rules, keda_queries, rule_queries
from tests.deploy.dashboards import (
    DASHBOARD_MODELS,
    grafana_intervals,
    load,
    needs_speculation,
    panel_queries,
    substitute,
)
from tests.deploy.live_cluster import (
    completion,
    frontend_scrape_job,
    has_values,
    pod_matchers,
    pod_name,
    scrape_jobs,
)
from tests.deploy.prometheus_rules import render_rule_file
from tests.e2e.reliability_helpers import ENCODER_TEXTS, PROMPTS, RERANK_PAIRS, embed, grpc_request
from tests.e2e.reliability_helpers import rerank as rerank_pairs
from tests.openai.frontend_helpers import Frontend, start_frontend, stop_frontend
from tests.server_helpers import DEFAULT_REPOSITORY, start_server, stop_server
from tooling.prometheus import PrometheusServer
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e

LOAD_SECONDS = 20.0
LLM_CLIENTS, ENCODER_CLIENTS = 4, 2
"""Half the llm clients go through the OpenAI frontend, by plain name (the split) and pinned id."""
TRAFFIC_SPLIT = "llm=1:100"
"""The frontend's split, so that its split series exist (one version is loaded)."""
SCRAPE_INTERVAL_S = 1
MAX_DATA_POINTS = 1000
"""Grafana's default for a panel about as wide as a screen."""


@dataclass
class Live:
    server: TritonServer
    frontend: Frontend
    prometheus: PrometheusServer
    start: float
    end: float
    """The load window (Unix seconds); queries are evaluated over it or at its end."""


def mixed_load(server: TritonServer, frontend: Frontend, seconds: float) -> list[str]:
    """LLM streams (some sharing a prompt prefix, so the prefix cache hits; half of the clients
    through the OpenAI frontend, by plain name and pinned id), embedding and rerank calls from
    parallel clients for `seconds`; returns the failures (there should be none)."""
    deadline = time.monotonic() + seconds
    failures: list[str] = []
    lock = threading.Lock()

    def llm_client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            prompt = rng.choice(PROMPTS)
            if seed % 2:
                model = rng.choice(("llm", "llm:1"))
                status = completion(frontend, model, prompt, rng.randint(8, 32))
                if status != 200:
                    with lock:
                        failures.append(f"frontend {model}: HTTP {status}")
                continue
            params = {"temperature": 0, "max_tokens": rng.randint(8, 32), "ignore_eos": True}
            outcome = grpc_request(server.grpc_url, "llm", prompt, params)
            if outcome.kind != "completed":
                with lock:
                    failures.append(f"llm: {outcome}")

    def encoder_client(seed: int) -> None:
        for i in itertools.count(seed):
            if time.monotonic() >= deadline:
                return
            try:
                if i % 2:
                    embed(server.http_url, ENCODER_TEXTS[: 1 + i % len(ENCODER_TEXTS)])
                else:
                    rerank_pairs(server.grpc_url, RERANK_PAIRS)
            except Exception as exc:  # a failed good request is a finding, not a crash
                with lock:
                    failures.append(f"encoder: {exc}")

    with ThreadPoolExecutor(LLM_CLIENTS + ENCODER_CLIENTS) as pool:
        futures = [pool.submit(llm_client, seed) for seed in range(LLM_CLIENTS)]
        futures += [pool.submit(encoder_client, seed) for seed in range(ENCODER_CLIENTS)]
        for future in futures:
            future.result()
    return failures


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Live:
    rules = render_rule_file(tmp_path_factory.mktemp("rules"), EVERYTHING_ON)
    server = start_server(DEFAULT_REPOSITORY)
    frontend = None
    prometheus = None
    try:
        frontend = start_frontend(
            server.grpc_url, DEFAULT_REPOSITORY, "--traffic-split", TRAFFIC_SPLIT
        )
        jobs = [*scrape_jobs(server), frontend_scrape_job(frontend.url.removeprefix("http://"))]
        prometheus = PrometheusServer(jobs, [rules], scrape_interval_s=SCRAPE_INTERVAL_S)
        prometheus.start()
        prometheus.wait_targets_up()
        start = time.time()
        assert mixed_load(server, frontend, LOAD_SECONDS) == []
        time.sleep(3 * SCRAPE_INTERVAL_S)  # the last scrapes and rule evaluations
        yield Live(server, frontend, prometheus, start, time.time())
    finally:
        if prometheus is not None:
            prometheus.stop()
        if frontend is not None:
            stop_frontend(frontend)
        stop_server(server)


def objects() -> list[dict]:
    return render("values-gpu.yaml", EVERYTHING_ON)


def test_every_rule_loads_and_evaluates_without_error(live):
    rules, _ = rule_queries(objects())
    loaded = [rule for group in live.prometheus.rule_groups() for rule in group["rules"]]
    assert [rule["query"] for rule in loaded] != []
    assert len(loaded) == len(rules)
    assert [(r["name"], r["lastError"]) for r in loaded if r["health"] != "ok"] == []


def test_recording_rules_have_series(live):
    _, recorded = rule_queries(objects())
    empty = [name for name in sorted(recorded) if not has_values(live.prometheus.query(name))]
    assert empty == []


def test_alert_expressions_evaluate_and_a_healthy_server_raises_none_of_the_critical_ones(live):
    rules, recorded = rule_queries(objects())
    alerts = [expr for expr in rules if expr not in recorded]
    for expr in alerts:
        live.prometheus.query(expr, at=live.end)  # raises on an evaluation error
    raised = {a["metric"]["alertname"] for a in live.prometheus.query("ALERTS", at=live.end)}
    assert raised.isdisjoint({"TritonServerDown", "TritonModelStubUnhealthy"})


def test_the_autoscalers_metrics_as_the_adapter_computes_them(live):
    for rule in adapter_rules(objects()):
        assert has_values(live.prometheus.query(rule.series_query)), rule.series_query
        role = "encoders" if rule.series.startswith("encoder_") else "llm"
        series = live.prometheus.query(rule.filled(pod_matchers(role)), at=live.end)
        assert [s["metric"] for s in series] == [{"pod": pod_name(role)}], rule.name
        assert has_values(series), rule.name


def test_the_keda_triggers_have_values(live):
    for name, queries in keda_queries().items():
        for query in queries:
            assert has_values(live.prometheus.query(query, at=live.end)), (name, query)


def label_values(prometheus: PrometheusServer, query: str) -> list[str]:
    """A Grafana `label_values(selector, label)` variable query, sent as Grafana's Prometheus
    data source sends it: GET /api/v1/label/<label>/values?match[]=<selector>."""
    selector, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query).groups()
    return prometheus.api(f"label/{label}/values", {"match[]": selector})


@pytest.mark.parametrize("dashboard", sorted(DASHBOARD_MODELS))
def test_the_dashboard_variables_list_what_is_served(live, dashboard):
    variables = {v["name"]: v for v in load(dashboard)["templating"]["list"]}

    def values(name: str, **chosen: str) -> list[str]:
        query = variables[name]["query"]["query"]
        for variable, value in chosen.items():
            query = query.replace(f"${variable}", value)
        return label_values(live.prometheus, query)

    assert values("namespace") == [NAMESPACE]
    models = values("model", namespace=NAMESPACE)
    assert models == sorted(DASHBOARD_MODELS[dashboard])
    for model in models:
        assert values("version", namespace=NAMESPACE, model=model) == ["1"]


@pytest.mark.parametrize("dashboard", sorted(DASHBOARD_MODELS))
def test_every_dashboard_panel_has_data_for_its_models(live, dashboard):
    interval, rate_interval = grafana_intervals(
        live.end - live.start, MAX_DATA_POINTS, SCRAPE_INTERVAL_S
    )
    step = max(1.0, (live.end - live.start) / MAX_DATA_POINTS)
    empty = []
    for model in DASHBOARD_MODELS[dashboard]:
        for panel in panel_queries(load(dashboard)):
            expr = substitute(
                panel.expr,
                model=model,
                namespace=NAMESPACE,
                interval=interval,
                rate_interval=rate_interval,
            )
            series = live.prometheus.query_range(expr, live.start, live.end, step)
            if not has_values(series) and not needs_speculation(panel):
                empty.append(f"{model}: {panel.title} [{panel.ref_id}]: {expr}")
    assert empty == []
