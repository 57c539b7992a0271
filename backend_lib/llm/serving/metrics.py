"""vLLM-named metrics for the llm model, fed from engine stats after every step.

Names, kinds and buckets follow vLLM (and Triton's vLLM backend) so existing dashboards work, and
the gauges follow the Gateway API Inference Extension's model-server protocol (TotalQueuedRequests:
`vllm:num_requests_waiting`, TotalRunningRequests: `vllm:num_requests_running`, KVCacheUtilization:
`vllm:kv_cache_usage_perc` in 0..1; `vllm:cache_config_info` carries `block_size` and `num_gpu_blocks`).
Every series exists from load with value 0, so `rate()`, dashboards and alerts see 0, not no data.

Structured outputs have no vLLM series; ours are `llm_structured_output_requests_total` (requests
admitted with a constraint), `llm_grammar_compile_seconds` (one per grammar compiled, cache hits
excluded) and `llm_structured_output_bitmask_seconds` (per step with constrained rows: the time the
worker thread spent filling the next-token bitmask, overlapped with the forward).

With LoRA enabled: vLLM's `vllm:lora_requests_info` gauge (labels `max_lora`,
`running_lora_adapters`, `waiting_lora_adapters`: comma-separated adapter names; the value is the
time of the latest step with that state, as vLLM's `set_to_current_time`, so the series with the
largest value is the current one; the Gateway API Inference Extension reads it for LoRA-aware
routing), from load as the empty state at 0, and `llm_lora_requests_total{lora_name}` (requests
admitted per adapter, every listed adapter from load at 0).

Per tenant and per priority (`llm_tenant_*`, `llm_priority_*`, labels bounded by
`max_tenant_labels`): serving/tenant_metrics.py. With an offload tier
(`kv_offloading_backend: native`): vLLM's `vllm:external_prefix_cache_*` and `vllm:kv_offload_*`
and our per-tier `llm_kv_offload_*`, serving/offload_metrics.py.

With speculative decoding (`speculative_config`): vLLM's `vllm:spec_decode_num_drafts_total`
(sequence-steps that verified drafts), `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}` (accepted drafts by their position
in the run, 0 .. num_speculative_tokens - 1), from load at 0. Acceptance rate: accepted / draft
tokens; mean accepted length: 1 + accepted / drafts.

`llm_request_failures_total{reason}`: requests answered with an error (invalid_input: refused at
parsing; queue_full; deadline_exceeded: past its deadline, waiting or running; queue_timeout: past
max_queue_wait_ms before admission; internal: the generation failed). It shows the model alive while it refuses bad
input, which Triton's own failure counter cannot tell from a dead Python-backend stub.
"""

from __future__ import annotations

import time

from backend_lib.llm.core.stats import EngineCounters, EngineStats
from backend_lib.llm.serving import offload_metrics, tenant_metrics
from backend_lib.metrics import Counter, MetricsSink

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

GRAMMAR_COMPILE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
BITMASK_FILL_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


FINISHED_REASONS = ("stop", "length", "abort", "error")
"""Every `finished_reason` of `vllm:request_success_total`, each exported from load."""

FAILURE_REASONS = ("invalid_input", "queue_full", "deadline_exceeded", "queue_timeout", "internal")
"""Every `reason` of `llm_request_failures_total`, each exported from load."""

EXTRA_LABELS = {
    "vllm:request_success_total": ("finished_reason",),
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
    "vllm:lora_requests_info": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    "llm_lora_requests_total": ("lora_name",),
    "llm_request_failures_total": ("reason",),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("position",),
    **tenant_metrics.LABELS,
    **offload_metrics.LABELS,
}
"""Per-series label names beyond the sink's constant ones (for `PrometheusMetrics(extra_labels=)`)."""


class LLMMetrics:
    """Gauges, counters and histograms of one llm model instance.

    `block_size` and `num_blocks` (the engine's KV pool in blocks, whatever the device) are
    exported once as `vllm:cache_config_info`, a gauge of value 1.
    """

    def __init__(
        self,
        sink: MetricsSink,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        lora_names: list[str] | None = None,
        max_loras: int = 0,
        num_speculative_tokens: int = 0,
        max_tenant_labels: int = 16,
        kv_offload: bool = False,
    ):
        """`lora_names`: the servable adapters when LoRA is enabled (None: no LoRA series);
        `num_speculative_tokens`: k of speculative decoding (0: none, no spec-decode series);
        `max_tenant_labels`: distinct tenants and priorities labelled in the per-tenant and
        per-priority series (serving/tenant_metrics.py); `kv_offload`: whether the engine has an
        offload tier (its series: serving/offload_metrics.py)."""
        # Kept on self: a pb_utils metric family leaves the metrics port when garbage-collected.
        self.cache_info = sink.gauge(
            "vllm:cache_config_info", "Information of the KV-cache config."
        )
        self.cache_info.set(1, block_size=str(block_size), num_gpu_blocks=str(num_blocks))
        self.running = sink.gauge("vllm:num_requests_running", "Requests currently running.")
        self.waiting = sink.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = sink.gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the blocks in use."
        )
        self.prefix_queries = sink.counter(
            "vllm:prefix_cache_queries_total", "Prefix-cache queries, in tokens."
        )
        self.prefix_hits = sink.counter(
            "vllm:prefix_cache_hits_total", "Prefix-cache hits, in tokens."
        )
        self.preemptions = sink.counter("vllm:num_preemptions_total", "Preemptions.")
        self.steps_interrupted = sink.counter(
            "llm_steps_interrupted_total",
            "Steps dropped at a layer boundary for a request that arrived during them and "
            "outranked their work (priority or fair share; recomputed).",
        )
        # Moves whenever the model answers a request with an error: with it, an alert can tell a
        # model refusing bad input (alive) from a dead stub (Triton counts failures, nothing else moves).
        self.request_failures = sink.counter(
            "llm_request_failures_total",
            "Requests the model refused or failed, by reason (invalid_input, queue_full, "
            "deadline_exceeded, queue_timeout, internal).",
        )
        self.prompt_tokens = sink.counter("vllm:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = sink.counter(
            "vllm:generation_tokens_total", "Generation tokens processed."
        )
        self.request_success = sink.counter(
            "vllm:request_success_total", "Finished requests, by finished_reason."
        )
        self.ttft = sink.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS
        )
        self.itl = sink.histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency, seconds.", ITL_BUCKETS
        )
        self.e2e = sink.histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.", E2E_BUCKETS
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = sink.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = sink.histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.structured_requests = sink.counter(
            "llm_structured_output_requests_total",
            "Requests admitted with a structured-output constraint.",
        )
        self.grammar_compile = sink.histogram(
            "llm_grammar_compile_seconds",
            "Structured-output grammar compile time (cache misses), seconds.",
            GRAMMAR_COMPILE_BUCKETS,
        )
        self.bitmask_fill = sink.histogram(
            "llm_structured_output_bitmask_seconds",
            "Next-token bitmask fill time per step with constrained rows, seconds.",
            BITMASK_FILL_BUCKETS,
        )
        self.lora_info = self.lora_requests = None
        self.max_lora = str(max_loras)
        self.lora_names = list(lora_names or [])
        if lora_names is not None:
            self.lora_info = sink.gauge(
                "vllm:lora_requests_info", "Running stats on LoRA requests."
            )
            self.lora_requests = sink.counter(
                "llm_lora_requests_total", "Requests admitted per LoRA adapter."
            )
        self.spec_decode: SpecDecodeMetrics | None = None
        if num_speculative_tokens:
            self.spec_decode = SpecDecodeMetrics(sink, num_speculative_tokens)
        self.tenants = tenant_metrics.TenantMetrics(sink, max_tenant_labels, TTFT_BUCKETS)
        self.kv_offload = offload_metrics.KVOffloadMetrics(sink) if kv_offload else None
        self._previous = EngineCounters()
        self._export_zeros()

    def _export_zeros(self) -> None:
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.set(0)
        for series in (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.steps_interrupted,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.structured_requests,
            self.grammar_compile,
            self.bitmask_fill,
        ):
            series.touch()
        for reason in FINISHED_REASONS:
            self.request_success.touch(finished_reason=reason)
        for reason in FAILURE_REASONS:
            self.request_failures.touch(reason=reason)
        if self.lora_info is not None:
            self.lora_info.set(0, **self._lora_labels({}, {}))
            for name in self.lora_names:
                self.lora_requests.touch(lora_name=name)

    def _lora_labels(self, running: dict[str, int], waiting: dict[str, int]) -> dict[str, str]:
        return {
            "max_lora": self.max_lora,
            "running_lora_adapters": ",".join(sorted(running)),
            "waiting_lora_adapters": ",".join(sorted(waiting)),
        }

    def record_failure(self, reason: str) -> None:
        self.request_failures.inc(reason=reason)

    def update(self, stats: EngineStats) -> None:
        """Apply one engine snapshot (called on the engine loop thread after each step)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        delta = stats.counters - self._previous
        self._previous = stats.counters
        _increment(
            (self.prefix_queries, delta.prefix_cache_queries),
            (self.prefix_hits, delta.prefix_cache_hits),
            (self.preemptions, delta.num_preemptions),
            (self.steps_interrupted, delta.steps_interrupted),
            (self.prompt_tokens, delta.prompt_tokens),
            (self.generation_tokens, delta.generation_tokens),
            (self.structured_requests, delta.structured_output_requests),
        )
        for value in stats.time_to_first_token:
            self.ttft.observe(value)
        for value in stats.inter_token_latency:
            self.itl.observe(value)
        for value in stats.grammar_compile_seconds:
            self.grammar_compile.observe(value)
        for value in stats.bitmask_fill_seconds:
            self.bitmask_fill.observe(value)
        for record in stats.finished:
            self.request_success.inc(finished_reason=record.finish_reason)
            self.e2e.observe(record.e2e_latency)
            self.request_prompt_tokens.observe(record.num_prompt_tokens)
            self.request_generation_tokens.observe(record.num_generation_tokens)
        self.tenants.update(stats)
        if self.kv_offload is not None and stats.kv_offload is not None:
            self.kv_offload.update(stats.kv_offload)
        if self.spec_decode is not None:
            self.spec_decode.update(delta)
        if self.lora_info is not None:
            labels = self._lora_labels(stats.running_lora_adapters, stats.waiting_lora_adapters)
            self.lora_info.set(time.time(), **labels)
            for name in stats.lora_requests:
                self.lora_requests.inc(lora_name=name)


class SpecDecodeMetrics:
    """vLLM's speculative-decoding counters (see the module docstring)."""

    def __init__(self, sink: MetricsSink, num_speculative_tokens: int):
        self.drafts = sink.counter(
            "vllm:spec_decode_num_drafts_total", "Sequence-steps that verified draft tokens."
        )
        self.draft_tokens = sink.counter(
            "vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified."
        )
        self.accepted_tokens = sink.counter(
            "vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
        )
        self.accepted_per_pos = sink.counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the drafted run.",
        )
        for series in (self.drafts, self.draft_tokens, self.accepted_tokens):
            series.touch()
        for position in range(num_speculative_tokens):
            self.accepted_per_pos.touch(position=str(position))

    def update(self, delta: EngineCounters) -> None:
        """Apply one snapshot's increments."""
        _increment(
            (self.drafts, delta.spec_decode_num_drafts),
            (self.draft_tokens, delta.spec_decode_num_draft_tokens),
            (self.accepted_tokens, delta.spec_decode_num_accepted_tokens),
        )
        for position, amount in enumerate(delta.spec_decode_num_accepted_tokens_per_pos):
            if amount:
                self.accepted_per_pos.inc(amount, position=str(position))


def _increment(*pairs: tuple[Counter, int]) -> None:
    """Add each snapshot increment to its counter (zero increments skipped)."""
    for counter, amount in pairs:
        if amount:
            counter.inc(amount)
