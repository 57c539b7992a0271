"""Every metric series exists from model load with value 0 (unit level; tests/e2e/test_metrics_from_load.py
checks the same on a real tritonserver), and the llm metrics carry vLLM's `model_name` label."""

from prometheus_client import generate_latest

from backend_lib.encoder.service import FAILURE_REASONS, EncoderMetrics
from backend_lib.llm.core.kv_offload import TierCounters
from backend_lib.llm.core.stats import EngineCounters, EngineStats, KVOffloadStats
from backend_lib.llm.serving.metrics import (
    EXTRA_LABELS,
    FINISHED_REASONS,
    LLMMetrics,
)
from backend_lib.llm.serving.metrics import (
    FAILURE_REASONS as LLM_FAILURE_REASONS,
)
from backend_lib.metrics import PrometheusMetrics, TritonMetrics, parse_prometheus_text
from tests.metric_names import (
    ENCODER_ZERO_FROM_LOAD,
    LLM_KV_OFFLOAD_ZERO_FROM_LOAD,
    LLM_ZERO_FROM_LOAD,
)

LLM_LABELS = {"model": "llm", "version": "1", "model_name": "llm"}
ENCODER_LABELS = {"model": "embedding", "version": "1"}


def llm_metrics(**options) -> tuple[PrometheusMetrics, LLMMetrics]:
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    metrics = LLMMetrics(
        sink.with_labels(model_name="llm"),
        max_model_len=64,
        block_size=16,
        num_blocks=123,
        **options,
    )
    return sink, metrics


def samples(sink: PrometheusMetrics) -> dict:
    return parse_prometheus_text(generate_latest(sink.registry).decode())


def value(scraped: dict, name: str, labels: dict, **extra: str) -> float:
    return scraped[(name, frozenset({**labels, **extra}.items()))]


def test_llm_series_are_zero_from_load_with_model_name():
    sink, _ = llm_metrics()
    scraped = samples(sink)
    for name in LLM_ZERO_FROM_LOAD:
        assert value(scraped, name, LLM_LABELS) == 0, name
    for reason in FINISHED_REASONS:
        assert value(scraped, "vllm:request_success_total", LLM_LABELS, finished_reason=reason) == 0
    for reason in LLM_FAILURE_REASONS:
        assert value(scraped, "llm_request_failures_total", LLM_LABELS, reason=reason) == 0
    info = value(
        scraped, "vllm:cache_config_info", LLM_LABELS, block_size="16", num_gpu_blocks="123"
    )
    assert info == 1
    # Every llm sample carries model_name; none lacks it.
    assert all(dict(labels).get("model_name") == "llm" for _, labels in scraped)


def test_offload_tier_series_are_zero_from_load_and_move_by_the_snapshots_increments():
    sink, metrics = llm_metrics(kv_offload=True)
    scraped = samples(sink)
    for name, extra in LLM_KV_OFFLOAD_ZERO_FROM_LOAD:
        assert value(scraped, name, LLM_LABELS, **dict(extra)) == 0, name
    absent_sink, _ = llm_metrics()
    assert not {name for name, _ in samples(absent_sink)} & {
        n for n, _ in LLM_KV_OFFLOAD_ZERO_FROM_LOAD
    }

    def snapshot(hits: int, stores: int, loaded: int) -> KVOffloadStats:
        return KVOffloadStats(
            external_queries=100,
            external_hits=hits,
            ram=TierCounters(hits=hits // 16, stores=stores),
            disk=TierCounters(errors=1),
            bytes_moved={"GPU_to_CPU": stores * 10, "CPU_to_GPU": loaded},
            copy_seconds=0.5,
            ram_usage=0.25,
            disk_usage=0.0,
        )

    stats = EngineStats(0, 0, 0, 0.0, EngineCounters(), kv_offload=snapshot(32, 4, 64))
    metrics.update(stats)
    stats.kv_offload = snapshot(48, 6, 96)  # cumulative: the series move by the increments
    metrics.update(stats)
    scraped = samples(sink)
    assert value(scraped, "vllm:external_prefix_cache_hits_total", LLM_LABELS) == 48
    assert value(scraped, "vllm:external_prefix_cache_queries_total", LLM_LABELS) == 100
    assert value(scraped, "llm_kv_offload_stores_total", LLM_LABELS, tier="ram") == 6
    assert value(scraped, "llm_kv_offload_errors_total", LLM_LABELS, tier="disk") == 1
    assert (
        value(scraped, "vllm:kv_offload_total_bytes_total", LLM_LABELS, transfer_type="CPU_to_GPU")
        == 96
    )
    assert value(scraped, "llm_kv_offload_usage_perc", LLM_LABELS, tier="ram") == 0.25


def test_llm_update_moves_the_zeroed_series():
    sink, metrics = llm_metrics()
    stats = EngineStats(
        num_running=2,
        num_waiting=3,
        num_swapped=0,
        kv_cache_usage=0.5,
        counters=EngineCounters(num_preemptions=4, prompt_tokens=7),
    )
    metrics.update(stats)
    scraped = samples(sink)
    assert value(scraped, "vllm:num_requests_waiting", LLM_LABELS) == 3
    assert value(scraped, "vllm:num_requests_running", LLM_LABELS) == 2
    assert value(scraped, "vllm:kv_cache_usage_perc", LLM_LABELS) == 0.5
    assert value(scraped, "vllm:num_preemptions_total", LLM_LABELS) == 4
    assert value(scraped, "vllm:prompt_tokens_total", LLM_LABELS) == 7


def test_encoder_series_are_zero_from_load():
    sink = PrometheusMetrics(ENCODER_LABELS, extra_labels={"encoder_failures_total": ["reason"]})
    EncoderMetrics(sink)
    scraped = samples(sink)
    for name in ENCODER_ZERO_FROM_LOAD:
        assert value(scraped, name, ENCODER_LABELS) == 0, name
    assert set(FAILURE_REASONS) == {"invalid_input", "deadline_exceeded", "unavailable", "internal"}
    for reason in FAILURE_REASONS:
        assert value(scraped, "encoder_failures_total", ENCODER_LABELS, reason=reason) == 0


class _Family:
    """Records pb_utils.MetricFamily children; the real one is covered end to end."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.children = name, []

    def Metric(self, labels, buckets=None):  # pb_utils' spelling
        child = _Child(labels)
        self.children.append(child)
        return child


class _Child:
    def __init__(self, labels):
        self.labels, self.increments = labels, []

    def increment(self, amount):
        self.increments.append(amount)


def test_triton_touch_creates_the_series_without_incrementing_and_with_labels_merges():
    class PbUtils:
        MetricFamily = _Family

    sink = TritonMetrics(PbUtils, {"model": "m", "version": "1"}).with_labels(model_name="m")
    counter = sink.counter("x_total", "x")
    counter.touch(reason="a")
    counter.inc(reason="a")
    family = counter._family
    assert [child.labels for child in family.children] == [
        {"model": "m", "version": "1", "model_name": "m", "reason": "a"}
    ]
    assert family.children[0].increments == [1.0]
