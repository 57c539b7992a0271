"""Right after load, before any request, the metrics port shows every series the dashboards, the
autoscaler and the alerts read (deploy/helm/triton-llm), with value 0: `rate()` and alerts see 0, not
no data. `vllm:cache_config_info` is 1 and names the KV pool the engine computed."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from backend_lib.config import from_parameters, triton_parameters
from backend_lib.device import resolve_dtype
from backend_lib.encoder.service import FAILURE_REASONS
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.kv_pool import GIB, KVCacheSpec, blocks_in
from backend_lib.llm.serving.metrics import FAILURE_REASONS as LLM_FAILURE_REASONS
from backend_lib.llm.serving.metrics import FINISHED_REASONS
from backend_lib.metrics import parse_prometheus_text
from tests.deploy.triton_metric_names import TRITON_CPU_METRICS
from tests.metric_names import ENCODER_ZERO_FROM_LOAD as ENCODER_ZERO
from tests.metric_names import LLM_KV_OFFLOAD_ZERO_FROM_LOAD as LLM_KV_OFFLOAD_ZERO
from tests.metric_names import LLM_ZERO_FROM_LOAD as LLM_ZERO
from tests.server_helpers import DEFAULT_REPOSITORY, REPO_ROOT

pytestmark = pytest.mark.e2e

LLM = {"model": "llm", "version": "1", "model_name": "llm"}


def _served_any_request(samples: dict) -> bool:
    return any(
        name.startswith("nv_inference_count") and value > 0 for (name, _), value in samples.items()
    )


@pytest.fixture
def fresh_server(server, make_server):
    """The session server when no test has sent it a request yet, else a new one on the same
    repository (the e2e files share the session server, and this test must see it untouched)."""
    if not _served_any_request(parse_prometheus_text(server.metrics_text())):
        return server
    return make_server(DEFAULT_REPOSITORY)


def expected_num_blocks(server) -> int | None:
    """The KV pool size as the engine computes it from the served llm config (None on a GPU,
    where it follows a memory profile rather than the config)."""
    with urllib.request.urlopen(
        f"http://{server.http_url}/v2/models/llm/config", timeout=10
    ) as reply:
        config = from_parameters(LLMConfig, triton_parameters(json.load(reply)))
    if config.num_blocks > 0:
        return config.num_blocks
    if torch.cuda.is_available():
        return None
    checkpoint = json.loads((REPO_ROOT / "models/shakespeare-llama/config.json").read_text())
    spec = KVCacheSpec(
        checkpoint["num_hidden_layers"],
        checkpoint["num_key_value_heads"],
        checkpoint["head_dim"],
        config.block_size,
        resolve_dtype(config.dtype, torch.device("cpu")),
    )
    return blocks_in(config.cpu_kv_cache_gb * GIB, spec)


def test_every_series_is_zero_from_load(fresh_server):
    samples = parse_prometheus_text(fresh_server.metrics_text())

    def value(name: str, labels: dict, **extra: str) -> float:
        key = (name, frozenset({**labels, **extra}.items()))
        assert key in samples, f"{name} {labels | extra} missing from the metrics port"
        return samples[key]

    for name in LLM_ZERO:
        assert value(name, LLM) == 0, name
    for reason in FINISHED_REASONS:
        assert value("vllm:request_success_total", LLM, finished_reason=reason) == 0
    for reason in LLM_FAILURE_REASONS:
        assert value("llm_request_failures_total", LLM, reason=reason) == 0
    for name, extra in LLM_KV_OFFLOAD_ZERO:  # the default llm has an offload tier
        assert value(name, LLM, **dict(extra)) == 0, (name, extra)
    for model in ("embedding", "rerank"):
        labels = {"model": model, "version": "1"}
        for name in ENCODER_ZERO:
            assert value(name, labels) == 0, (model, name)
        for reason in FAILURE_REASONS:
            assert value("encoder_failures_total", labels, reason=reason) == 0
    for model in ("llm", "embedding", "rerank"):  # Triton's own, read by the chart's alerts
        failures = [
            v
            for (name, labels), v in samples.items()
            if name == "nv_inference_request_failure_total" and dict(labels)["model"] == model
        ]
        assert failures and not any(failures), (model, failures)

    (info,) = [
        dict(labels) | {"value": v}
        for (name, labels), v in samples.items()
        if name == "vllm:cache_config_info"
    ]
    assert info["value"] == 1
    assert {k: info[k] for k in LLM} == LLM
    assert info["block_size"] == "16"
    expected = expected_num_blocks(fresh_server)
    num_blocks = int(info["num_gpu_blocks"])
    assert num_blocks == expected if expected is not None else num_blocks > 0


def test_triton_names_the_chart_may_use_are_exported(server):
    """The documented Triton names (tests/deploy/triton_metric_names.py) as on the wire."""
    families = {
        line.split()[2] for line in server.metrics_text().splitlines() if line.startswith("# TYPE ")
    }
    assert families >= TRITON_CPU_METRICS, sorted(TRITON_CPU_METRICS - families)
