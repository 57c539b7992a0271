"""Compute kernels of the LLM engine: Triton kernels (GPU) and their PyTorch twins (CPU path, references),
plus C++ CPU kernels (kernels/csrc/, built by `make setup`) where they beat the PyTorch twins.

The caller picks a backend ("torch" or "triton") and calls through `kernel_ops(backend)`. This
package imports only torch, triton and itself (tests/kernels/test_independence.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels.activation import (
    gelu_tanh_and_mul_cpu,
    gelu_tanh_and_mul_triton,
    silu_and_mul_cpu,
    silu_and_mul_triton,
)
from kernels.fused_moe import fused_moe_torch, fused_moe_triton
from kernels.kv_cache import write_kv_cache_cpu, write_kv_cache_triton
from kernels.lora import LoRASegments, add_lora_torch, add_lora_triton, lora_segments
from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_triton,
    plan_paged_attention_cpu,
)
from kernels.rmsnorm import rms_norm_cpu, rms_norm_triton
from kernels.rotary import apply_rotary_cpu, apply_rotary_triton, rope_cos_sin_cache
from kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton

__all__ = ["KernelOps", "LoRASegments", "kernel_ops", "lora_segments", "rope_cos_sin_cache"]


@dataclass(frozen=True)
class KernelOps:
    """The engine's kernels for one backend (see each module for the contracts)."""

    paged_attention: Callable
    write_kv_cache: Callable
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    apply_token_bitmask: Callable
    add_lora: Callable
    fused_moe: Callable | None = None
    """Mixture-of-experts MLP over stacked expert weights (kernels/fused_moe.py)."""
    gelu_tanh_and_mul: Callable | None = None
    """Gemma's gated activation (kernels/activation.py); a default so that existing backends
    built without it keep working (both here set it)."""
    plan_attention: Callable | None = None
    """Builds a batch's host-side attention plan once per step, passed to every layer's
    paged_attention as `plan=` (backends that need none leave it None)."""


_BACKENDS = {
    # The C++ ops (attention, KV writes, RMSNorm, rotary, SiLU/GELU-and-mul) on CPU tensors when
    # the library is built (kernels/cpu_extension.py), else (and on CUDA) the PyTorch twins.
    "torch": KernelOps(
        paged_attention=paged_attention_cpu,
        write_kv_cache=write_kv_cache_cpu,
        rms_norm=rms_norm_cpu,
        apply_rotary=apply_rotary_cpu,
        silu_and_mul=silu_and_mul_cpu,
        apply_token_bitmask=apply_token_bitmask_torch,
        add_lora=add_lora_torch,
        fused_moe=fused_moe_torch,
        gelu_tanh_and_mul=gelu_tanh_and_mul_cpu,
        plan_attention=plan_paged_attention_cpu,
    ),
    "triton": KernelOps(
        paged_attention=paged_attention_triton,
        write_kv_cache=write_kv_cache_triton,
        rms_norm=rms_norm_triton,
        apply_rotary=apply_rotary_triton,
        silu_and_mul=silu_and_mul_triton,
        apply_token_bitmask=apply_token_bitmask_triton,
        add_lora=add_lora_triton,
        fused_moe=fused_moe_triton,
        gelu_tanh_and_mul=gelu_tanh_and_mul_triton,
    ),
}


def kernel_ops(backend: str) -> KernelOps:
    """Kernels of `backend` ("torch" or "triton")."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: expected 'torch' or 'triton'")
    return _BACKENDS[backend]
