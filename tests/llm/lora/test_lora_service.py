"""LoRA through the llm model's request path: `lora_name` in sampling_parameters (the vLLM
backend's field), adapters listed in `<version>/multi_lora.json` with paths relative to the model
directory, the vLLM backend's errors, and the LoRA metrics (from load, then per step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from backend_lib.errors import InputError
from backend_lib.llm.serving.metrics import EXTRA_LABELS, LLMMetrics
from backend_lib.llm.serving.service import LLMService
from backend_lib.llm.serving.triton_request import parse_generate_request
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text
from backend_lib.model_context import ModelContext
from tests.llm.engine_helpers import greedy
from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
from tests.llm.service_helpers import service_parameters
from tests.metric_names import LLM_LORA_ZERO_FROM_LOAD

pytestmark = pytest.mark.usefixtures("single_torch_thread")
LIMITS = dict(max_prompt_bytes=1000, max_logprobs=20, max_n=8)
PROMPT = "karo mite lusa ven"


def _inputs(lora_name: str | None, prompt: str = PROMPT) -> dict[str, np.ndarray]:
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    if lora_name is not None:
        params["lora_name"] = lora_name
    return {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
    }


def test_lora_name_is_read_from_sampling_parameters():
    request = parse_generate_request(_inputs("r4"), **LIMITS)
    assert request.lora_name == "r4" and request.params.max_tokens == 6
    assert parse_generate_request(_inputs(None), **LIMITS).lora_name is None
    bad = _inputs(None)
    bad["sampling_parameters"] = np.array([b'{"lora_name": 3}'], dtype=object)
    with pytest.raises(InputError, match="lora_name must be a non-empty string"):
        parse_generate_request(bad, **LIMITS)


def _service(tmp_path: Path, enable_lora: bool) -> LLMService:
    """A service loaded as model.py loads it: model dir tmp_path, version 1."""
    model_dir, _, adapters = lora_checkpoint("LlamaForCausalLM")
    version = tmp_path / "1"
    version.mkdir(exist_ok=True)
    listing = {name: os.path.relpath(path, tmp_path) for name, (path, _) in adapters.items()}
    listing["missing"] = "does/not/exist"
    (version / "multi_lora.json").write_text(json.dumps(listing))
    parameters = {
        **service_parameters(model_dir),
        "enable_lora": str(enable_lora).lower(),
        "max_loras": "2",
        "max_lora_rank": "16",
    }
    context = ModelContext("llm", "1", tmp_path, torch.device("cpu"), parameters, {})
    return LLMService.from_context(context, None)


def _text(service: LLMService, lora_name: str | None) -> str:
    job = service.submit(_inputs(lora_name))
    pieces = []
    for tensors, _ in service.responses(job):
        assert not isinstance(tensors, Exception), tensors
        pieces.append(tensors["text_output"][0].decode())
    return "".join(pieces)


def test_service_serves_adapters_listed_in_multi_lora_json(tmp_path):
    model_dir, _, adapters = lora_checkpoint("LlamaForCausalLM")
    service = _service(tmp_path, enable_lora=True)
    try:
        engine = make_lora_engine(model_dir, {n: p for n, (p, _) in adapters.items()})
        for name in (None, "r4", "r16"):
            (want,) = engine.generate([PROMPT], greedy(6), lora_names=[name])
            assert _text(service, name) == want.outputs[0].text
        with pytest.raises(InputError) as info:
            service.submit(_inputs("nope"))
        assert str(info.value) == (
            "LoRA nope is not supported, we currently support ['r4', 'r8-rslora', 'r16', 'missing']"
        )
        with pytest.raises(InputError, match="LoRA adapter 'missing' .* no such directory"):
            service.submit(_inputs("missing"))
    finally:
        service.shutdown()


def test_service_without_enable_lora_refuses_lora_name(tmp_path):
    service = _service(tmp_path, enable_lora=False)
    try:
        with pytest.raises(InputError, match=r"^LoRA feature is not enabled\.$"):
            service.submit(_inputs("r4"))
        assert _text(service, None)
    finally:
        service.shutdown()


LABELS = {"model": "llm", "version": "1", "model_name": "llm"}


def _scrape(sink: PrometheusMetrics) -> dict:
    return parse_prometheus_text(generate_latest(sink.registry).decode())


def test_lora_metrics_from_load_then_per_step():
    model_dir, _, adapters = lora_checkpoint("LlamaForCausalLM")
    engine = make_lora_engine(model_dir, {n: p for n, (p, _) in adapters.items()}, max_loras=1)
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    metrics = LLMMetrics(
        sink.with_labels(model_name="llm"),
        128,
        8,
        64,
        lora_names=engine.lora_registry.names,
        max_loras=1,
    )
    scraped = _scrape(sink)
    assert {name for name, _ in scraped if name in LLM_LORA_ZERO_FROM_LOAD} == set(
        LLM_LORA_ZERO_FROM_LOAD
    )
    assert all(v == 0 for (name, _), v in scraped.items() if name in LLM_LORA_ZERO_FROM_LOAD)
    empty = {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert scraped[("vllm:lora_requests_info", frozenset((LABELS | empty).items()))] == 0
    for name in adapters:
        key = ("llm_lora_requests_total", frozenset((LABELS | {"lora_name": name}).items()))
        assert scraped[key] == 0
    for i, name in enumerate(["r4", "r16", "r4"]):
        engine.add_request(f"q{i}", None, greedy(3), prompt_token_ids=[5, 6, 7], lora_name=name)
    engine.step()  # max_loras=1: r4 runs, r16 waits (and the second r4 behind it)
    metrics.update(engine.stats())
    scraped = _scrape(sink)
    state = {"max_lora": "1", "running_lora_adapters": "r4", "waiting_lora_adapters": "r16,r4"}
    assert scraped[("vllm:lora_requests_info", frozenset((LABELS | state).items()))] > 1e9
    counts = {
        dict(labels)["lora_name"]: value
        for (name, labels), value in scraped.items()
        if name == "llm_lora_requests_total"
    }
    assert counts == {"r4": 2, "r8-rslora": 0, "r16": 1}
