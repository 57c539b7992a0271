"""LLMService test helpers: a service built from a model context like model.py does, its request
tensors, two prompts, and their expected greedy texts from a bare engine."""

from __future__ import annotations

import json

import numpy as np
import torch

from backend_lib.llm.serving.service import LLMService
from backend_lib.metrics import MetricsSink
from backend_lib.model_context import ModelContext
from tests.llm.engine_helpers import greedy, make_engine

PROMPTS = ["karo mite lusa ven", "tor al is qu bre"]
MAX_TOKENS = 8


def service_parameters(model_dir) -> dict[str, str]:
    """config.pbtxt parameters of a small CPU service over `model_dir`."""
    return {
        "model": str(model_dir),
        "dtype": "float32",
        "kernel_backend": "torch",
        "block_size": "8",
        "num_blocks": "64",
        "max_model_len": "128",
    }


def service_from_context(model_dir, sink: MetricsSink | None = None) -> LLMService:
    parameters = service_parameters(model_dir)
    context = ModelContext("llm", "1", model_dir, torch.device("cpu"), parameters, {})
    return LLMService.from_context(context, sink)


def inputs(prompt: str) -> dict[str, np.ndarray]:
    params = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    return {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([params.encode()], dtype=object),
    }


def expected_texts(model_dir) -> list[str]:
    engine = make_engine(model_dir)
    outputs = engine.generate(PROMPTS, greedy(MAX_TOKENS))
    return [output.outputs[0].text for output in outputs]
