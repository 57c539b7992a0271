"""One small metrics interface with two sinks.

Inside tritonserver the metrics go through `pb_utils.MetricFamily`, so they appear on the server's
metrics port (:8002) next to Triton's own; outside it (tests, scripts) through `prometheus_client`.
Every metric carries the labels given at creation (`model` and `version`), plus any per-call labels.
A series exists once created: `touch` creates it at 0 without changing it, so a metric whose label
values are known in advance is scraped as 0 from model load rather than absent until first used.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Counter(Protocol):
    def inc(self, amount: float = 1.0, **labels: str) -> None: ...
    def touch(self, **labels: str) -> None: ...


class Gauge(Protocol):
    def set(self, value: float, **labels: str) -> None: ...
    def touch(self, **labels: str) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float, **labels: str) -> None: ...
    def touch(self, **labels: str) -> None: ...


class MetricsSink(Protocol):
    """Creates metrics; `labels` are the constant labels of every series (model, version)."""

    def with_labels(self, **labels: str) -> MetricsSink:
        """The same sink with more constant labels (e.g. vLLM's `model_name`)."""
        ...

    def counter(self, name: str, description: str) -> Counter: ...
    def gauge(self, name: str, description: str) -> Gauge: ...
    def histogram(self, name: str, description: str, buckets: Sequence[float]) -> Histogram: ...


class _TritonSeries:
    """One pb_utils metric family; a child metric per distinct label set, created on first use."""

    def __init__(self, family: Any, labels: Mapping[str, str], buckets: Sequence[float] | None):
        self._family, self._labels, self._buckets = family, dict(labels), buckets
        self._children: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def pb_objects(self) -> list[Any]:
        """The pb_utils family and the metrics made from it so far."""
        with self._lock:
            return [self._family, *self._children.values()]

    def _child(self, extra: Mapping[str, str]) -> Any:
        key = tuple(sorted(extra.items()))
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    labels = {**self._labels, **extra}
                    if self._buckets is None:
                        child = self._family.Metric(labels=labels)
                    else:
                        child = self._family.Metric(labels=labels, buckets=list(self._buckets))
                    self._children[key] = child
        return child

    def touch(self, **labels: str) -> None:
        self._child(labels)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).increment(amount)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


class TritonMetrics:
    """Metrics exported by tritonserver through the Python backend's `pb_utils.MetricFamily`."""

    def __init__(
        self, pb_utils: Any, labels: Mapping[str, str], series: list[_TritonSeries] | None = None
    ):
        self._pb, self._labels = pb_utils, dict(labels)
        self._all: list[_TritonSeries] = [] if series is None else series
        """Every series of this sink and of those `with_labels` made from it."""

    def with_labels(self, **labels: str) -> TritonMetrics:
        return TritonMetrics(self._pb, {**self._labels, **labels}, self._all)

    def keep_until_exit(self) -> None:
        """Leak every pb_utils family and metric made so far, on purpose (a model's `finalize`
        calls this: its stub exits next). One destroyed while the stub exits crashes it
        (python_backend#429, fixed after Triton 2.51) and its model is never reported unloaded;
        destroyed earlier, in `finalize`, they stalled a new version's stub creating the same
        families. They go with the process, as when the stub crashed."""
        for series in self._all:
            for obj in series.pb_objects():
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

    def _series(self, name: str, description: str, kind: Any, buckets=None) -> _TritonSeries:
        family = self._pb.MetricFamily(name=name, description=description, kind=kind)
        series = _TritonSeries(family, self._labels, buckets)
        self._all.append(series)
        return series

    def counter(self, name: str, description: str) -> Counter:
        return self._series(name, description, self._pb.MetricFamily.COUNTER)

    def gauge(self, name: str, description: str) -> Gauge:
        return self._series(name, description, self._pb.MetricFamily.GAUGE)

    def histogram(self, name: str, description: str, buckets: Sequence[float]) -> Histogram:
        return self._series(name, description, self._pb.MetricFamily.HISTOGRAM, buckets)


class _PrometheusSeries:
    def __init__(self, metric: Any, labels: Mapping[str, str]):
        self._metric, self._labels = metric, dict(labels)

    def _child(self, extra: Mapping[str, str]) -> Any:
        return self._metric.labels(**self._labels, **extra)

    def touch(self, **labels: str) -> None:
        self._child(labels)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)


class PrometheusMetrics:
    """The same metrics through `prometheus_client` (a private registry unless one is given).

    Extra per-call label names must be declared up front: `extra_labels` maps a metric name to them.
    """

    def __init__(
        self,
        labels: Mapping[str, str],
        registry: Any = None,
        extra_labels: Mapping[str, Sequence[str]] | None = None,
    ):
        import prometheus_client

        self._prom = prometheus_client
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._labels = dict(labels)
        self._extra = dict(extra_labels or {})

    def with_labels(self, **labels: str) -> PrometheusMetrics:
        """Shares this sink's registry, so metric names must not repeat across the two."""
        return PrometheusMetrics({**self._labels, **labels}, self.registry, self._extra)

    def _names(self, name: str) -> list[str]:
        return [*self._labels, *self._extra.get(name, ())]

    def counter(self, name: str, description: str) -> Counter:
        # prometheus_client appends `_total` itself; keep the exported name identical to Triton's.
        base = name[: -len("_total")] if name.endswith("_total") else name
        metric = self._prom.Counter(base, description, self._names(name), registry=self.registry)
        return _PrometheusSeries(metric, self._labels)

    def gauge(self, name: str, description: str) -> Gauge:
        metric = self._prom.Gauge(name, description, self._names(name), registry=self.registry)
        return _PrometheusSeries(metric, self._labels)

    def histogram(self, name: str, description: str, buckets: Sequence[float]) -> Histogram:
        metric = self._prom.Histogram(
            name, description, self._names(name), buckets=list(buckets), registry=self.registry
        )
        return _PrometheusSeries(metric, self._labels)


def parse_prometheus_text(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse Prometheus exposition text into {(sample name, labels): value} (tests, benchmarks)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples
