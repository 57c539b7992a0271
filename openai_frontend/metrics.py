"""The frontend's own request metrics (Prometheus text on `GET /metrics`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class FrontendMetrics:
    """Requests by endpoint and status, and their latency by endpoint (to the response's end);
    the same by model and version for the requests routed to a model version, and the traffic
    splits (openai_frontend/traffic.py): their weights and the requests they rerouted."""

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
            buckets=LATENCY_BUCKETS,
        )
        self.model_requests = Counter(
            "openai_frontend_model_requests",
            "HTTP requests routed to a model version, by Triton model, version and status code",
            ["model", "version", "status"],
            registry=self.registry,
        )
        self.model_latency = Histogram(
            "openai_frontend_model_request_duration_seconds",
            "Latency of the requests routed to a model version, until the response's last byte",
            ["model", "version"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.split_weight = Gauge(
            "openai_frontend_split_weight",
            "The traffic split's weight of each model version, in percent",
            ["model", "version"],
            registry=self.registry,
        )
        self.split_rerouted = Counter(
            "openai_frontend_split_rerouted",
            "Requests the split assigned to a version that was not ready, served by another",
            ["model", "version"],
            registry=self.registry,
        )
        self._split_series: set[tuple[str, str]] = set()

    def observe(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def observe_routed(self, model: str, version: str, status: int, seconds: float) -> None:
        self.model_requests.labels(model, version, str(status)).inc()
        self.model_latency.labels(model, version).observe(seconds)

    def rerouted(self, model: str, version: str) -> None:
        self.split_rerouted.labels(model, version).inc()

    def set_splits(self, splits: dict[str, dict[str, int]]) -> None:
        """The weights in force; a version that left every split drops its series."""
        current = {(m, v) for m, weights in splits.items() for v in weights}
        for model, version in self._split_series - current:
            self.split_weight.remove(model, version)
        for model, weights in splits.items():
            for version, weight in weights.items():
                self.split_weight.labels(model, version).set(weight)
                self.split_rerouted.labels(model, version)  # exported from 0
        self._split_series = current

    def render(self) -> bytes:
        return generate_latest(self.registry)
