"""kernel_ops: each backend's set of kernel functions, unknown backends refused by name."""

from __future__ import annotations

import pytest

from kernels import kernel_ops
from kernels.activation import silu_and_mul_cpu
from kernels.kv_cache import write_kv_cache_cpu
from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_triton,
    plan_paged_attention_cpu,
)
from kernels.rmsnorm import rms_norm_cpu, rms_norm_triton
from kernels.rotary import apply_rotary_cpu


def test_kernel_ops_returns_the_backends_functions():
    # The C++ ops where built, else the PyTorch twins (tests/kernels/test_paged_attention_cpu.py,
    # test_elementwise_cpu.py).
    assert kernel_ops("torch").paged_attention is paged_attention_cpu
    assert kernel_ops("torch").plan_attention is plan_paged_attention_cpu
    assert kernel_ops("torch").rms_norm is rms_norm_cpu
    assert kernel_ops("torch").apply_rotary is apply_rotary_cpu
    assert kernel_ops("torch").silu_and_mul is silu_and_mul_cpu
    assert kernel_ops("torch").write_kv_cache is write_kv_cache_cpu
    assert kernel_ops("triton").paged_attention is paged_attention_triton
    assert kernel_ops("triton").rms_norm is rms_norm_triton


def test_kernel_ops_rejects_unknown_backend_by_name():
    with pytest.raises(ValueError, match="'cuda'"):
        kernel_ops("cuda")
