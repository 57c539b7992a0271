"""Gated activations of the MLPs on a fused [gate | up] input: SiLU-and-mul (Llama-style models),
silu(gate) * up, and GELU(tanh)-and-mul (Gemma), gelu_tanh(gate) * up with transformers'
"gelu_pytorch_tanh": 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import cpu_extension


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:], computed in float32, returned in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_torch`'s contract, the "torch" backend's entry: the C++ op (one pass per row,
    kernels/csrc/elementwise_cpu.cpp) on tensors it takes, else the twin. The twin's bits when I is
    a multiple of the vector width (8 or 16 floats)."""
    if not cpu_extension.takes(x):
        return silu_and_mul_torch(x)
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], x2d.shape[1] // 2), dtype=x.dtype)
    torch.ops.llm_cpu.silu_and_mul(x2d, out)
    return out.view(*x.shape[:-1], out.shape[1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, 2*I] with unit stride along the last dim (copies only when it must)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_and_mul_torch` (same contract)."""
    inter_size = x.shape[-1] // 2
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], inter_size), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(*x.shape[:-1], inter_size)
    block = min(1024, triton.next_power_of_2(inter_size))
    grid = (x2d.shape[0], triton.cdiv(inter_size, block))
    _silu_and_mul_kernel[grid](x2d, out, x2d.stride(0), out.stride(0), inter_size, BLOCK=block)
    return out.view(*x.shape[:-1], inter_size)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> gelu_tanh(x[..., :I]) * x[..., I:], computed in float32, returned in x's
    dtype."""
    gate, up = x.chunk(2, dim=-1)
    return (F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)


def gelu_tanh_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh_and_mul_torch`'s contract, the "torch" backend's entry: the C++ op (one pass per
    row, kernels/csrc/elementwise_cpu.cpp) on tensors it takes, else the twin."""
    if not cpu_extension.takes(x):
        return gelu_tanh_and_mul_torch(x)
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], x2d.shape[1] // 2), dtype=x.dtype)
    torch.ops.llm_cpu.gelu_tanh_and_mul(x2d, out)
    return out.view(*x.shape[:-1], out.shape[1])


@triton.jit
def _gelu_tanh_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter_size, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    inner = tl.minimum(
        tl.maximum(inner, -15.0), 15.0
    )  # tanh is +-1 in float32 past that: no exp overflow
    # tanh(y) = 2 sigmoid(2y) - 1: no tanh in every Triton backend (the interpreter included).
    out = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `gelu_tanh_and_mul_torch` (same contract)."""
    inter_size = x.shape[-1] // 2
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], inter_size), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(*x.shape[:-1], inter_size)
    block = min(1024, triton.next_power_of_2(inter_size))
    grid = (x2d.shape[0], triton.cdiv(inter_size, block))
    _gelu_tanh_and_mul_kernel[grid](x2d, out, x2d.stride(0), out.stride(0), inter_size, BLOCK=block)
    return out.view(*x.shape[:-1], inter_size)
