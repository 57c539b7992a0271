"""The llm HPA's metric, as the chart's prometheus-adapter rule computes it from a real Prometheus
scraping a real tritonserver, rises above the HPA's target while the llm is overloaded (many
concurrent streams into a small `max_num_seqs`) and falls back to 0 once the load is gone: the
autoscaler would add pods under that load and let them go after it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.deploy.chart import by_kind, render
from tests.deploy.chart_queries import adapter_rules
from tests.deploy.live_cluster import pod_matchers, scrape_jobs
from tests.e2e.reliability_helpers import PROMPTS, grpc_request
from tests.server_helpers import REPO_ROOT, start_server, stop_server
from tooling.prometheus import PrometheusServer
from tooling.repository import DEFAULT_MODELS, ModelSpec, write_model

pytestmark = pytest.mark.e2e

MAX_NUM_SEQS = 2
STREAMS = 24
MAX_TOKENS = 96
WAITING_METRIC = "vllm_num_requests_waiting"


def write_small_llm_repository(repository) -> None:
    """The default llm with room for only MAX_NUM_SEQS running sequences."""
    (llm,) = [spec for spec in DEFAULT_MODELS if spec.kind == "llm"]
    parameters = {
        **llm.parameters,
        "model": str(REPO_ROOT / "models" / "shakespeare-llama"),
        "max_num_seqs": str(MAX_NUM_SEQS),
    }
    write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), repository)


def hpa_target_and_query() -> tuple[float, str]:
    """The llm HPA's target for the waiting-requests metric and the adapter query behind it."""
    objects = render("values-cpu.yaml")
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["rel-triton-llm-llm"]
    (target,) = [
        m["pods"]["target"]["averageValue"]
        for m in hpa["spec"]["metrics"]
        if m["pods"]["metric"]["name"] == WAITING_METRIC
    ]
    (rule,) = [r for r in adapter_rules(objects) if r.name == WAITING_METRIC]
    return float(target), rule.filled(pod_matchers("llm"))


def watch(prometheus: PrometheusServer, query: str, readings: list[float], stop: threading.Event):
    """Append the query's value (0 when absent) to `readings` every half second until `stop`."""
    while not stop.is_set():
        series = prometheus.query(query)
        readings.append(float(series[0]["value"][1]) if series else 0.0)
        time.sleep(0.5)


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.5)


def test_waiting_requests_metric_rises_above_the_hpa_target_under_overload_and_falls_after(
    tmp_path,
):
    target, query = hpa_target_and_query()
    assert 2 * target < STREAMS - MAX_NUM_SEQS  # the overload can exceed the target
    write_small_llm_repository(tmp_path / "repository")
    server = start_server(tmp_path / "repository")
    prometheus = PrometheusServer(scrape_jobs(server, ("llm",)))
    readings: list[float] = []
    stop = threading.Event()
    try:
        prometheus.start()
        prometheus.wait_targets_up()
        with ThreadPoolExecutor(STREAMS + 1) as pool:
            watcher = pool.submit(watch, prometheus, query, readings, stop)
            params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            streams = [
                pool.submit(grpc_request, server.grpc_url, "llm", PROMPTS[i % len(PROMPTS)], params)
                for i in range(STREAMS)
            ]
            outcomes = [s.result() for s in streams]
            during_load = list(readings)
            wait_for(lambda: readings[-1] == 0.0, timeout_s=30)
            stop.set()
            watcher.result()
    finally:
        stop.set()
        prometheus.stop()
        stop_server(server)
    assert [o.kind for o in outcomes] == ["completed"] * STREAMS
    assert max(during_load) > target, during_load
    assert readings[-1] == 0.0, readings
