"""The frontend's own request metrics (Prometheus text on `GET /metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FrontendMetrics:
    """Requests by endpoint and status, and their latency by endpoint (to the response's end)."""

    def __init__(self) -> None:
        # A registry per app: several apps in one process (tests) keep their own counts.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "openai_frontend_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "openai_frontend_request_duration_seconds",
            "HTTP request latency, until the last byte of the response",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
