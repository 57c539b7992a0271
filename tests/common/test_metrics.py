from prometheus_client import generate_latest

from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text

LABELS = {"model": "m", "version": "1"}


def scrape(metrics: PrometheusMetrics) -> dict:
    return parse_prometheus_text(generate_latest(metrics.registry).decode())


def key(name: str, **extra: str) -> tuple:
    return name, frozenset({**LABELS, **extra}.items())


def test_prometheus_sink_exports_triton_names_with_constant_labels():
    metrics = PrometheusMetrics(LABELS, extra_labels={"failures_total": ["reason"]})
    counter = metrics.counter("failures_total", "failures")
    gauge = metrics.gauge("running", "running")
    histogram = metrics.histogram("batch_size", "size", [1, 4, 16])
    counter.inc(2, reason="bad")
    counter.inc(reason="bad")
    gauge.set(5)
    for value in (1, 3, 20):
        histogram.observe(value)
    samples = scrape(metrics)
    assert samples[key("failures_total", reason="bad")] == 3
    assert samples[key("running")] == 5
    assert samples[key("batch_size_bucket", le="1.0")] == 1
    assert samples[key("batch_size_bucket", le="4.0")] == 2
    assert samples[key("batch_size_count")] == 3
    assert samples[key("batch_size_sum")] == 24


class FakeFamily:
    """Stands in for pb_utils.MetricFamily's recording only; the real one is covered end to end."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind
        FakeFamily.created.append(self)
        self.children = []

    def Metric(self, labels, buckets=None):  # pb_utils' spelling
        child = FakeMetric(labels, buckets)
        self.children.append(child)
        return child


class FakeMetric:
    def __init__(self, labels, buckets):
        self.labels, self.buckets, self.values = labels, buckets, []

    def increment(self, v):
        self.values.append(v)

    def observe(self, v):
        self.values.append(v)


def test_triton_sink_creates_one_child_per_label_set():
    from backend_lib.metrics import TritonMetrics

    class PbUtils:
        MetricFamily = FakeFamily

    metrics = TritonMetrics(PbUtils, LABELS)
    counter = metrics.counter("x_total", "x")
    counter.inc(reason="a")
    counter.inc(reason="a")
    counter.inc(reason="b")
    family = FakeFamily.created[-1]
    assert [c.labels for c in family.children] == [
        {**LABELS, "reason": "a"},
        {**LABELS, "reason": "b"},
    ]
    histogram = metrics.histogram("h", "h", [1, 2])
    histogram.observe(1.5)
    assert FakeFamily.created[-1].children[0].buckets == [1, 2]


def test_a_sink_kept_until_exit_outlives_every_reference_to_it():
    """A model's finalize keeps its pb_utils objects alive: none may be destroyed while the stub
    exits (python_backend#429)."""
    import gc
    import weakref

    from backend_lib.metrics import TritonMetrics

    class PbUtils:
        MetricFamily = FakeFamily

    metrics = TritonMetrics(PbUtils, LABELS)
    metrics.counter("x_total", "x").inc(reason="a")
    metrics.with_labels(model_name="m").gauge("g", "g").touch()  # a derived sink's series too
    made = FakeFamily.created[-2:]
    kept = [weakref.ref(obj) for family in made for obj in (family, *family.children)]
    assert len(kept) == 4
    metrics.keep_until_exit()
    del metrics, made
    FakeFamily.created.clear()
    gc.collect()
    assert all(ref() is not None for ref in kept)
