"""A/B testing, live: a real tritonserver serving two versions of `llm` (different checkpoints), the
OpenAI frontend in front of it splitting `llm` 50/50 between them, and a real Prometheus scraping
both (as the llm pod and its sidecar) while requests go through the frontend by plain name and by
pinned id. Every panel of the versions dashboard then returns a series for each version, and the
TritonLLMVersionRegression expressions join the two versions' real series (with margins that make
them true, they return the model's series; with the chart's defaults, equal versions stay quiet on
errors)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.deploy.chart import EVERYTHING_ON, NAMESPACE, merge, render
from tests.deploy.chart_queries import rule_queries
from tests.deploy.dashboards import grafana_intervals, load, panel_queries, substitute
from tests.deploy.live_cluster import completion, frontend_scrape_job, has_values, scrape_jobs
from tests.deploy.prometheus_rules import render_rule_file
from tests.e2e.llm_helpers import shakespeare_and_tiny_llama
from tests.e2e.reliability_helpers import PROMPTS
from tests.openai.frontend_helpers import start_frontend, stop_frontend
from tests.server_helpers import start_server, stop_server
from tooling.prometheus import PrometheusServer

pytestmark = pytest.mark.e2e

LOAD_SECONDS = 15.0
CLIENTS = 4
SCRAPE_INTERVAL_S = 1
VERSIONS = {"1", "2"}
# Margins below zero make each regression expression true wherever both versions have data.
ALWAYS = {
    "errorRateMargin": -1,
    "minRequestsPerSecond": 0,
    "ttftP99Margin": -1,
    "window": "30s",
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    repository = shakespeare_and_tiny_llama(tmp_path_factory.mktemp("repository"))
    rules = render_rule_file(tmp_path_factory.mktemp("rules"))
    server = start_server(repository, ["--model-control-mode=explicit", "--load-model=llm"])
    frontend = prometheus = None
    try:
        frontend = start_frontend(server.grpc_url, repository, "--traffic-split", "llm=1:50,2:50")
        jobs = [
            *scrape_jobs(server, ("llm",)),
            frontend_scrape_job(frontend.url.removeprefix("http://")),
        ]
        prometheus = PrometheusServer(jobs, [rules], scrape_interval_s=SCRAPE_INTERVAL_S)
        prometheus.start()
        prometheus.wait_targets_up()
        start = time.time()
        deadline = time.monotonic() + LOAD_SECONDS

        def client(seed: int) -> list[str]:
            rng, failures = random.Random(seed), []
            while time.monotonic() < deadline:
                model = rng.choice(("llm", "llm", "llm:1", "llm:2"))
                status = completion(frontend, model, rng.choice(PROMPTS), rng.randint(4, 16))
                if status != 200:
                    failures.append(f"{model}: HTTP {status}")
            return failures

        with ThreadPoolExecutor(CLIENTS) as pool:
            failures = [f for found in pool.map(client, range(CLIENTS)) for f in found]
        assert failures == []
        time.sleep(3 * SCRAPE_INTERVAL_S)
        yield prometheus, start, time.time()
    finally:
        if prometheus is not None:
            prometheus.stop()
        if frontend is not None:
            stop_frontend(frontend)
        stop_server(server)


def test_every_versions_panel_has_a_series_per_version(live):
    prometheus, start, end = live
    interval, rate_interval = grafana_intervals(end - start, 1000, SCRAPE_INTERVAL_S)
    step = max(1.0, (end - start) / 1000)
    missing = []
    for panel in panel_queries(load("versions.json")):
        expr = substitute(
            panel.expr,
            model="llm",
            namespace=NAMESPACE,
            interval=interval,
            rate_interval=rate_interval,
        )
        series = prometheus.query_range(expr, start, end, step)
        versions = {s["metric"].get("version") for s in series if has_values([s])}
        if versions != VERSIONS:
            missing.append(f"{panel.title} [{panel.ref_id}]: versions {sorted(versions)}")
    assert missing == []


def test_the_split_is_what_the_frontend_reports(live):
    prometheus, _, end = live
    weights = prometheus.query(
        f'openai_frontend_split_weight{{namespace="{NAMESPACE}",model="llm"}}', at=end
    )
    assert {s["metric"]["version"]: float(s["value"][1]) for s in weights} == {"1": 50, "2": 50}


def test_the_regression_expressions_join_the_two_versions(live):
    prometheus, _, end = live
    overrides = merge(
        EVERYTHING_ON, {"monitoring": {"prometheusRule": {"versionRegression": ALWAYS}}}
    )
    rules, recorded = rule_queries(render(None, overrides))
    expressions = [e for e in rules if "openai_frontend_model_requests_total" in e] + [
        e for e in rules if 'version="2"' in e and "time_to_first_token" in e
    ]
    assert len(expressions) == 2
    for expr in expressions:
        series = prometheus.query(expr, at=end)
        assert [s["metric"] for s in series] == [{"namespace": NAMESPACE, "model": "llm"}], expr
    # With the chart's margins, two versions failing nothing raise no error-rate regression.
    rules, _ = rule_queries(render(None, EVERYTHING_ON))
    (errors,) = [e for e in rules if "openai_frontend_model_requests_total" in e]
    assert prometheus.query(errors, at=end) == []
