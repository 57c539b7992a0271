"""LoRA test helpers: per architecture, a tiny checkpoint (engine_helpers) with three PEFT
adapters built by `peft` on it (ranks 4, 8 with rsLoRA, 16; every projection), and an engine
serving them."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.config_helpers import llm_config
from tests.llm.engine_helpers import engine_checkpoint
from tooling.lora_adapters import build_lora_adapter

ADAPTERS: dict[str, dict[str, Any]] = {
    "r4": dict(rank=4, alpha=8, seed=11),
    "r8-rslora": dict(rank=8, alpha=6, seed=12, use_rslora=True),
    "r16": dict(rank=16, alpha=24, seed=13),
}
"""Adapter name -> build_lora_adapter settings."""

_BUILT: dict[str, tuple[Path, Any, dict[str, tuple[Path, Any]]]] = {}


def lora_checkpoint(arch: str) -> tuple[Path, Any, dict[str, tuple[Path, Any]]]:
    """(model dir, HF base model, {adapter name: (adapter dir, PeftModel)}); built once."""
    if arch not in _BUILT:
        model_dir, hf = engine_checkpoint(arch)
        root = Path(tempfile.mkdtemp(prefix=f"lora-{arch}-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        adapters = {}
        for name, settings in ADAPTERS.items():
            adapters[name] = (root / name, build_lora_adapter(hf, root / name, **settings))
        _BUILT[arch] = (model_dir, hf, adapters)
    return _BUILT[arch]


def make_lora_engine(model_dir: Path, lora_modules: dict[str, Path], **overrides: Any) -> LLMEngine:
    """Engine with LoRA on (3 slots, rank 16 unless overridden) serving `lora_modules`."""
    settings = dict(enable_lora=True, max_loras=3, max_lora_rank=16) | overrides
    config = llm_config(model_dir, **settings)
    return LLMEngine(config, model_dir, torch.device("cpu"), lora_modules=lora_modules)
