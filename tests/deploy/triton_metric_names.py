"""Triton's own metric names the chart's queries may use (Triton 2.51's metrics docs), as exported on
the wire (counters without a `_total` suffix), plus Prometheus' synthetic `up`. The CPU ones are
checked against a real tritonserver's scrape in tests/e2e/test_metrics_from_load.py."""

TRITON_CPU_METRICS = frozenset(
    {
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_inference_pending_request_count",
    }
)
TRITON_GPU_METRICS = frozenset(
    {
        "nv_gpu_utilization",
        "nv_gpu_memory_total_bytes",
        "nv_gpu_memory_used_bytes",
        "nv_gpu_power_usage",
    }
)
PROMETHEUS_SYNTHETIC = frozenset({"up"})
