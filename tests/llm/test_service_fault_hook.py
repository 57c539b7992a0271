"""The test-only fault hook of LLMService (BACKEND_LIB_FAULT_INJECTION): a request whose prompt holds
the marker fails inside the engine step with "injected fault"; requests running beside it finish with
their normal output and the KV pool is released. Without the variable nothing is injected."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend_lib.llm.serving.service import FAULT_INJECTION_ENV, LLMService
from backend_lib.model_context import ModelContext
from tests.llm.test_engine import (  # noqa: F401 (single_torch_thread is a fixture)
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    single_torch_thread,
)

pytestmark = pytest.mark.usefixtures("single_torch_thread")
MARKER = "kaboom"
PROMPTS = ["karo mite lusa ven", "tor al is qu bre"]
MAX_TOKENS = 8


def service_from_context(model_dir) -> LLMService:
    parameters = {
        "model": str(model_dir),
        "dtype": "float32",
        "kernel_backend": "torch",
        "block_size": "8",
        "num_blocks": "64",
        "max_model_len": "128",
    }
    context = ModelContext("llm", "1", model_dir, torch.device("cpu"), parameters, {})
    return LLMService.from_context(context, None)


def inputs(prompt: str) -> dict[str, np.ndarray]:
    params = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    return {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([params.encode()], dtype=object),
    }


def collect(service: LLMService, job) -> tuple[str, Exception | None]:
    """(streamed text, error) of a submitted job."""
    text = ""
    for result, _final in service.responses(job):
        if isinstance(result, Exception):
            return text, result
        text += b"".join(result["text_output"]).decode()
    return text, None


def expected_texts(model_dir) -> list[str]:
    engine = make_engine(model_dir)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    return [output.outputs[0].text for output in outputs]


def test_marked_request_fails_alone_and_the_pool_is_released(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    monkeypatch.setenv(FAULT_INJECTION_ENV, MARKER)
    service = service_from_context(model_dir)
    try:
        assert service.fault_marker == MARKER and service.engine.fault_injector is not None
        # The faulty request is submitted between two good ones, so they share engine steps.
        jobs = [
            service.submit(inputs(PROMPTS[0])),
            service.submit(inputs(f"ka {MARKER} ro")),
            service.submit(inputs(PROMPTS[1])),
        ]
        results = [collect(service, job) for job in jobs]
        assert results[1][0] == "" and isinstance(results[1][1], RuntimeError)
        assert "injected fault" in str(results[1][1])
        assert [results[0], results[2]] == [(text, None) for text in expected_texts(model_dir)]
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


def test_without_the_variable_nothing_is_injected(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    service = service_from_context(model_dir)
    try:
        assert service.fault_marker is None and service.engine.fault_injector is None
        text, error = collect(service, service.submit(inputs(f"ka {MARKER} ro")))
        assert error is None and text
    finally:
        service.shutdown()
