"""The LLMConfig the LLM tests run under: CPU-friendly float32, PyTorch kernels, a small KV pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend_lib.llm.config import LLMConfig

BLOCK_SIZE = 8


def llm_config(model_dir: Path, **overrides: Any) -> LLMConfig:
    settings = dict(
        model=str(model_dir),
        dtype="float32",
        kernel_backend="torch",
        block_size=BLOCK_SIZE,
        num_blocks=64,
        max_model_len=128,
    )
    config = LLMConfig(**{**settings, **overrides})
    config.validate()
    return config
