"""kernel_ops / resolve_kernel_backend: backend choice per device and setting."""

from __future__ import annotations

import pytest
import torch

from backend_lib.config import ConfigError
from kernels import kernel_ops, resolve_kernel_backend
from kernels.paged_attention import paged_attention_torch, paged_attention_triton
from kernels.rmsnorm import rms_norm_torch, rms_norm_triton


def test_kernel_ops_returns_the_backends_functions():
    assert kernel_ops("torch").paged_attention is paged_attention_torch
    assert kernel_ops("torch").rms_norm is rms_norm_torch
    assert kernel_ops("triton").paged_attention is paged_attention_triton
    assert kernel_ops("triton").rms_norm is rms_norm_triton


def test_kernel_ops_rejects_unknown_backend_by_name():
    with pytest.raises(ValueError, match="'cuda'"):
        kernel_ops("cuda")


@pytest.mark.parametrize(
    "setting,device,expected",
    [
        ("auto", "cpu", "torch"),
        ("auto", "cuda", "triton"),
        ("auto", torch.device("cuda", 1), "triton"),
        ("torch", "cuda", "torch"),
        ("torch", "cpu", "torch"),
        ("triton", "cuda", "triton"),
    ],
)
def test_resolve(setting, device, expected):
    assert resolve_kernel_backend(setting, device) == expected


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernel_backend.*CUDA"):
        resolve_kernel_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernel_backend("triton", "cpu") == "triton"


def test_unknown_setting_is_a_config_error():
    with pytest.raises(ConfigError, match="kernel_backend.*'fast'"):
        resolve_kernel_backend("fast", "cpu")
