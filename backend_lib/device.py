"""Device and dtype selection for a Triton model instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backend_lib.config import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def select_device(args: Mapping[str, Any] | None = None) -> torch.device:
    """CUDA when Triton gives this instance a GPU (`model_instance_kind` GPU) and CUDA works,
    CPU otherwise. KIND_MODEL (a model placing itself, as a tensor-parallel one does: rank r on
    GPU r) starts on GPU 0 where CUDA works. Without Triton args (tests, scripts) CUDA is used
    when available."""
    if args is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind = str(args.get("model_instance_kind", "CPU")).upper().removeprefix("KIND_")
    if kind == "GPU" and torch.cuda.is_available():
        return torch.device("cuda", int(args.get("model_instance_device_id", 0) or 0))
    if kind == "MODEL" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX tiles). Elsewhere
    (e.g. AVX2 only) PyTorch emulates bfloat16 GEMMs, several times slower than float32."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """Map a dtype name to torch. `auto` is bfloat16 on CUDA and on CPUs with native bfloat16
    (`cpu_has_native_bfloat16`), float32 on other CPUs."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bfloat16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(key, name, f"expected one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
