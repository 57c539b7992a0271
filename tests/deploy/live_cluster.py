"""A stand-in for the chart's pods, for the tests that check its queries against live metrics: one
real tritonserver scraped by a real Prometheus once per role, each scrape job attaching the
`namespace` and `pod` labels Kubernetes service discovery would give that role's pod (the chart's
queries select pods by those labels), and the OpenAI frontend in front of it scraped as the llm
pod's sidecar."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from tests.deploy.chart import NAMESPACE, RELEASE
from tests.openai.frontend_helpers import Frontend
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


def frontend_scrape_job(address: str) -> ScrapeJob:
    """The OpenAI frontend's /metrics at `address` (host:port), as the llm pod's sidecar."""
    return ScrapeJob("openai-frontend", address, {"namespace": NAMESPACE, "pod": pod_name("llm")})


def completion(frontend: Frontend, model: str, prompt: str, max_tokens: int) -> int:
    """A completion through the OpenAI frontend; its HTTP status."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{frontend.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def has_values(series: list[dict]) -> bool:
    """Whether a query result holds at least one number (NaN, which Grafana draws as a gap, is
    not one): instant results carry `value`, range results `values`."""
    for one in series:
        # A scalar result is [time, "value"]; a vector's series has `value`, a matrix's `values`.
        points = one.get("values") or [one["value"]] if isinstance(one, dict) else [one]
        if any(value not in ("NaN", "+Inf", "-Inf") for _, value in points):
            return True
    return False
