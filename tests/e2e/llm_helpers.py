"""Shared by the llm end-to-end tests (test_llm.py, test_llm_structured_outputs.py): greedy
params, the default llm model's engine run in-process (what the server's outputs must equal), and
the server's llm metrics, read after requests end."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch

from backend_lib.config import from_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.metrics import parse_prometheus_text
from tests.llm.engine_helpers import engine_checkpoint
from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model

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


def write_versioned_llm(
    repository: Path, checkpoints: Mapping[str, Path], **parameters: str
) -> Path:
    """`llm` in `repository` with one version per `checkpoints` entry ({version: checkpoint dir},
    linked as `<version>/checkpoint`), all loaded at once (version_policy all), float32 on a small
    KV pool; `parameters` override config.pbtxt parameters. Returns `repository`."""
    spec = ModelSpec(
        "llm",
        "llm",
        {
            "model": "{version}/checkpoint",
            "dtype": "float32",
            "cpu_kv_cache_gb": "0.05",
            "max_num_seqs": "8",
            **parameters,
        },
        versions=tuple(int(v) for v in checkpoints),
        max_batch_size=0,
        version_policy="all: {}",
    )
    write_model(spec, repository)
    for version, checkpoint in checkpoints.items():
        (repository / "llm" / str(version) / "checkpoint").symlink_to(checkpoint)
    return repository


def shakespeare_and_tiny_llama(repository: Path, **parameters: str) -> Path:
    """Two versions of `llm` that answer differently: 1 the default Shakespeare checkpoint, 2 a
    tiny random Llama."""
    checkpoints = {
        "1": REPO_ROOT / "models" / "shakespeare-llama",
        "2": engine_checkpoint("LlamaForCausalLM")[0],
    }
    return write_versioned_llm(repository, checkpoints, **parameters)
