"""The `kernel_backend` setting (auto, torch, triton) resolved to a kernel backend for a device.

Config policy, kept here rather than in `kernels/` so that the kernels depend on nothing in the
project.
"""

from __future__ import annotations

import os

import torch

from backend_lib.config import ConfigError


def resolve_kernel_backend(setting: str, device: torch.device | str) -> str:
    """Map the `kernel_backend` setting to a backend for `device`: auto is triton on CUDA, torch
    elsewhere. Triton off CUDA runs only in Triton's interpreter (TRITON_INTERPRET=1, tests).
    Raises ConfigError (a ValueError) naming the setting otherwise."""
    device_type = torch.device(device).type
    if setting == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if setting == "torch":
        return "torch"
    if setting == "triton":
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "kernel_backend",
                setting,
                f"needs a CUDA device (this instance runs on {device_type!r}); use 'torch' or "
                "'auto' there (Triton's CPU interpreter, TRITON_INTERPRET=1, is for tests only)",
            )
        return "triton"
    raise ConfigError("kernel_backend", setting, "expected one of auto, triton, torch")
