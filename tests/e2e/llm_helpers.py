"""Shared by the llm end-to-end tests (test_llm.py, test_llm_structured_outputs.py): greedy
params, the default llm model's engine run in-process (what the server's outputs must equal), and
the server's llm metrics, read after requests end."""

from __future__ import annotations

import time

import torch

from backend_lib.config import from_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.metrics import parse_prometheus_text
from tooling.repository import DEFAULT_MODELS, REPO_ROOT

GREEDY = {"temperature": 0, "max_tokens": 24}
LABELS = frozenset({"model": "llm", "version": "1", "model_name": "llm"}.items())


def default_llm_engine() -> LLMEngine:
    """The default repository's llm model, as its config.pbtxt configures it, on the CPU."""
    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    config = from_parameters(LLMConfig, spec.parameters)
    return LLMEngine.from_config(
        config, REPO_ROOT / "model_repository" / "llm", torch.device("cpu")
    )


def direct_text(engine: LLMEngine, prompt: str, **params) -> str:
    (output,) = engine.generate([prompt], SamplingParams(**{**GREEDY, **params}))
    return output.outputs[0].text


def metric(server, name: str, **labels: str) -> float:
    samples = parse_prometheus_text(server.metrics_text())
    return samples.get((name, LABELS | frozenset(labels.items())), 0.0)


def assert_engine_idle(server, timeout: float = 30) -> None:
    """Once requests end, nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (
        metric(server, "vllm:kv_cache_usage_perc") > 0
        or metric(server, "vllm:num_requests_running") > 0
    ):
        time.sleep(0.2)
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert metric(server, "vllm:num_requests_running") == 0
