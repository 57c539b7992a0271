"""End to end: multi-LoRA under a real tritonserver. Two adapters and the base model streamed
concurrently over gRPC give the direct engine's outputs; an unknown `lora_name`, a bad adapter
directory and a rank over max_lora_rank each get a clear error while other streams carry on; the
LoRA metrics count the adapters' requests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

from backend_lib.config import from_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import grpc_stream
from tests.server_helpers import start_server, stop_server
from tooling.lora_adapters import build_lora_adapter
from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e

CHECKPOINT = REPO_ROOT / "models" / "shakespeare-llama"
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
PROMPTS = {None: "ROMEO:", "r4": "ROMEO:", "r8": "JULIET:\nO Romeo,"}
LABELS = {"model": "llm", "version": "1", "model_name": "llm"}


@pytest.fixture(scope="module")
def lora_repository(tmp_path_factory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """(repository, llm parameters, multi_lora.json listing): the default llm with max_lora_rank 8
    serving random adapters of the Shakespeare model (rank 4, rank 8, a rank-16 one over the
    limit) and a listed directory that does not exist; beside it `llm_no_lora`, the same model
    with `enable_lora: false`."""
    root = tmp_path_factory.mktemp("lora-repo")
    base = transformers.LlamaForCausalLM.from_pretrained(
        CHECKPOINT, dtype=torch.float32, local_files_only=True
    )
    listing = {}
    for name, rank in (("r4", 4), ("r8", 8), ("big", 16)):
        build_lora_adapter(base, root / "adapters" / name, rank=rank, alpha=2 * rank, seed=rank)
        listing[name] = f"../../adapters/{name}"  # relative to the model directory
    listing["broken"] = "../../adapters/missing"
    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    parameters = {**spec.parameters, "model": str(CHECKPOINT), "max_lora_rank": "8"}
    write_model(
        ModelSpec("llm", "llm", parameters, max_batch_size=0, lora_modules=listing), root / "repo"
    )
    without = {**spec.parameters, "model": str(CHECKPOINT), "enable_lora": "false"}
    write_model(ModelSpec("llm_no_lora", "llm", without, max_batch_size=0), root / "repo")
    assert not (root / "repo" / "llm_no_lora" / "1" / "multi_lora.json").exists()
    return root / "repo", parameters, listing


@pytest.fixture(scope="module")
def lora_server(lora_repository) -> Iterator[TritonServer]:
    server = start_server(lora_repository[0])
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def direct_engine(lora_repository) -> LLMEngine:
    repository, parameters, listing = lora_repository
    config = from_parameters(LLMConfig, parameters)
    modules = {name: repository / "llm" / path for name, path in listing.items()}
    return LLMEngine.from_config(config, repository / "llm", torch.device("cpu"), modules)


def _direct(engine: LLMEngine, name: str | None) -> str:
    params = SamplingParams(**GREEDY)
    (out,) = engine.generate([PROMPTS[name]], params, lora_names=[name])
    return out.outputs[0].text


def _stream(server, name: str | None, prompt: str | None = None, model: str = "llm", **extra):
    params = {**GREEDY, **extra} | ({} if name is None else {"lora_name": name})
    return grpc_stream(server.grpc_url, prompt or PROMPTS.get(name, "ROMEO:"), params, model=model)


def test_adapters_and_base_stream_concurrently_like_the_direct_engine(lora_server, direct_engine):
    server = lora_server
    names = [None, "r4", "r8"] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: _stream(server, n), names))
    for name, result in zip(names, results, strict=True):
        assert result.error is None, (name, result.error)
        assert result.text == _direct(direct_engine, name), name
        assert len(result.responses) > 1  # streamed
    texts = {name: _direct(direct_engine, name) for name in (None, "r4")}
    assert texts[None] != texts["r4"]  # the adapter really changes the output

    # Bad requests fail alone, each with a clear error, while a long stream carries on.
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(_stream, server, "r4", None, max_tokens=120)
        errors = {bad: pool.submit(_stream, server, bad) for bad in ("nope", "broken", "big")}
        errors = {bad: future.result().error for bad, future in errors.items()}
        long_result = long.result()
    assert (
        "LoRA nope is not supported, we currently support ['r4', 'r8', 'big', 'broken']"
        in (errors["nope"])
    )
    assert "LoRA adapter 'broken'" in errors["broken"] and "no such directory" in errors["broken"]
    assert "exceeds max_lora_rank=8" in errors["big"]
    assert long_result.error is None
    (want,) = direct_engine.generate(
        [PROMPTS["r4"]], SamplingParams(**{**GREEDY, "max_tokens": 120}), lora_names=["r4"]
    )
    assert long_result.text == want.outputs[0].text

    scraped = parse_prometheus_text(server.metrics_text())
    key = ("llm_lora_requests_total", frozenset((LABELS | {"lora_name": "r4"}).items()))
    assert scraped[key] == 3
    infos = [labels for name, labels in scraped if name == "vllm:lora_requests_info"]
    assert infos and all(dict(labels)["max_lora"] == "2" for labels in infos)


def test_lora_name_on_a_model_without_lora_is_the_vllm_error(lora_server):
    result = _stream(lora_server, "sonnets", model="llm_no_lora")
    assert result.error is not None and "LoRA feature is not enabled." in result.error
    assert _stream(lora_server, None, model="llm_no_lora").error is None


def test_default_repository_serves_the_sonnets_adapter(server):
    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    model_dir = REPO_ROOT / "model_repository" / "llm"
    modules = {name: model_dir / path for name, path in spec.lora_modules.items()}
    engine = LLMEngine.from_config(
        from_parameters(LLMConfig, spec.parameters), model_dir, torch.device("cpu"), modules
    )
    prompt = "Shall I compare thee"
    (want,) = engine.generate([prompt], SamplingParams(**GREEDY), lora_names=["sonnets"])
    result = _stream(server, "sonnets", prompt)
    assert result.error is None and result.text == want.outputs[0].text
    assert result.text != _stream(server, None, prompt).text
