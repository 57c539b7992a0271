"""The metric series that must exist from model load with value 0 (dashboards, alerts and the
autoscaler read them), checked at unit level (tests/common) and on a real tritonserver (tests/e2e)."""

LLM_ZERO_FROM_LOAD = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
    "llm_structured_output_requests_total",
    "llm_grammar_compile_seconds_count",
    "llm_structured_output_bitmask_seconds_count",
    "llm_steps_interrupted_total",
]

ENCODER_ZERO_FROM_LOAD = [
    "encoder_requests_total",
    "encoder_items_total",
    "encoder_batch_size_count",
    "encoder_batch_tokens_count",
    "encoder_batch_requests_count",
    "encoder_queue_seconds_count",
    "encoder_queue_seconds_sum",
    "encoder_compute_seconds_count",
]

LLM_KV_OFFLOAD_ZERO_FROM_LOAD = {
    ("vllm:external_prefix_cache_queries_total", ()),
    ("vllm:external_prefix_cache_hits_total", ()),
    ("vllm:kv_offload_total_time_total", ()),
    *(
        ("vllm:kv_offload_total_bytes_total", (("transfer_type", kind),))
        for kind in ("GPU_to_CPU", "CPU_to_GPU", "CPU_to_DISK", "DISK_to_CPU")
    ),
    *(
        (f"llm_kv_offload_{count}_total", (("tier", tier),))
        for count in ("hits", "stores", "evictions", "errors")
        for tier in ("ram", "disk")
    ),
    *(("llm_kv_offload_usage_perc", (("tier", tier),)) for tier in ("ram", "disk")),
}
"""With kv_offloading_backend native only (the default repository's llm has it): (name, extra
labels) of the offload tier's series."""

LLM_LORA_ZERO_FROM_LOAD = [
    "vllm:lora_requests_info",
    "llm_lora_requests_total",
]
"""With enable_lora only, and labelled: the info gauge's empty-state series (max_lora,
running_lora_adapters="", waiting_lora_adapters="") and one request counter per listed adapter."""
