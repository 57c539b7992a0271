"""resolve_kernel_backend: the `kernel_backend` setting per device, config errors by name."""

from __future__ import annotations

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.execution.kernel_backend import resolve_kernel_backend


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
