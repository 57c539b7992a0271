"""The metric names the backend exports on the metrics port, collected from backend_lib's own metric
definitions (LLMMetrics, EncoderMetrics) through a recording sink: counters and gauges under their
name, histograms as `_bucket`, `_sum` and `_count` (the names Prometheus stores). And the names the
OpenAI frontend exports on its own port's /metrics, read from its registry (FrontendMetrics) the
same way: counters as `_total`, gauges under their name, histograms as the three series."""

from __future__ import annotations

from backend_lib.encoder.service import EncoderMetrics
from backend_lib.llm.serving.metrics import LLMMetrics
from openai_frontend.metrics import FrontendMetrics


class _Series:
    def inc(self, amount: float = 1.0, **labels: str) -> None: ...
    def set(self, value: float, **labels: str) -> None: ...
    def observe(self, value: float, **labels: str) -> None: ...
    def touch(self, **labels: str) -> None: ...


class NameRecorder:
    """A MetricsSink that only records the names it is asked to create."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def with_labels(self, **labels: str) -> NameRecorder:
        return self

    def counter(self, name: str, description: str) -> _Series:
        self.names.add(name)
        return _Series()

    def gauge(self, name: str, description: str) -> _Series:
        self.names.add(name)
        return _Series()

    def histogram(self, name: str, description: str, buckets) -> _Series:
        self.names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return _Series()


def backend_metric_names() -> frozenset[str]:
    sink = NameRecorder()
    LLMMetrics(
        sink,
        max_model_len=16,
        block_size=16,
        num_blocks=1,
        num_speculative_tokens=1,
        kv_offload=True,
    )
    EncoderMetrics(sink)
    return frozenset(sink.names)


_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def frontend_metric_names() -> frozenset[str]:
    names = set()
    for family in FrontendMetrics().registry.collect():
        names.update(f"{family.name}{suffix}" for suffix in _SUFFIXES[family.type])
    return frozenset(names)
