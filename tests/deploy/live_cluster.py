"""A stand-in for the chart's pods, for the tests that check its queries against live metrics: one
real tritonserver scraped by a real Prometheus once per role, each scrape job attaching the
`namespace` and `pod` labels Kubernetes service discovery would give that role's pod (the chart's
queries select pods by those labels)."""

from __future__ import annotations

from tests.deploy.chart import NAMESPACE, RELEASE
from tooling.prometheus import ScrapeJob
from tooling.tritonserver import TritonServer

ROLES = ("llm", "encoders")


def pod_name(role: str) -> str:
    """A pod of the role's Deployment, as the chart names them (`<release>-triton-llm-<role>-...`)."""
    return f"{RELEASE}-triton-llm-{role}-7d9f8-x2k4q"


def pod_matchers(role: str) -> str:
    """The label matchers prometheus-adapter sends for a request about that one pod."""
    return f'namespace="{NAMESPACE}",pod="{pod_name(role)}"'


def scrape_jobs(server: TritonServer, roles: tuple[str, ...] = ROLES) -> list[ScrapeJob]:
    address = f"127.0.0.1:{server.metrics_port}"
    return [
        ScrapeJob(f"triton-{role}", address, {"namespace": NAMESPACE, "pod": pod_name(role)})
        for role in roles
    ]


def has_values(series: list[dict]) -> bool:
    """Whether a query result holds at least one number (NaN, which Grafana draws as a gap, is
    not one): instant results carry `value`, range results `values`."""
    for one in series:
        # A scalar result is [time, "value"]; a vector's series has `value`, a matrix's `values`.
        points = one.get("values") or [one["value"]] if isinstance(one, dict) else [one]
        if any(value not in ("NaN", "+Inf", "-Inf") for _, value in points):
            return True
    return False
