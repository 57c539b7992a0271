"""Gated activations of the MLPs on a fused [gate | up] input, under one contract:

    act_and_mul(x, activation): x [..., 2*I] -> act(x[..., :I]) * x[..., I:], computed in float32,
    returned in x's dtype,

for each activation of ACTIVATIONS:
- "silu" (Llama-style models): silu(g) = g sigmoid(g);
- "gelu_tanh" (Gemma): transformers' "gelu_pytorch_tanh",
  0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).

`act_and_mul_torch` is the PyTorch twin (the reference); `act_and_mul_triton` is one Triton kernel
with the activation a constexpr; `act_and_mul_cpu` is the "torch" backend's entry, the C++ op (one
body over the activation, kernels/csrc/elementwise_cpu.cpp, one pass per row) on tensors it takes,
else the twin. The C++ SiLU gives the twin's bits when I is a multiple of the vector width (8 or 16
floats). The kernel tables and the models take one callable per activation:
silu_and_mul_{torch,triton,cpu} and gelu_tanh_and_mul_{torch,triton,cpu} are these, bound to it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import cpu_extension

ACTIVATIONS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}
"""The activations of the contract, each with its C++ op's name (torch.ops.llm_cpu.<name>)."""

_TORCH_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _op_name(activation: str) -> str:
    """The C++ op of `activation`; a ValueError for an activation the contract does not have."""
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"unknown activation {activation!r}: expected one of {tuple(ACTIVATIONS)}"
        ) from None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, 2*I] with unit stride along the last dim (copies only when it must)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def act_and_mul_torch(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The PyTorch twin of the module's contract."""
    _op_name(activation)  # a ValueError for an unknown activation
    gate, up = x.chunk(2, dim=-1)
    return (_TORCH_ACTIVATIONS[activation](gate.float()) * up.float()).to(x.dtype)


def act_and_mul_cpu(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The module's contract, the "torch" backend's entry: the C++ op on tensors it takes, else
    the twin."""
    op_name = _op_name(activation)
    if not cpu_extension.takes(x):
        return act_and_mul_torch(x, activation)
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], x2d.shape[1] // 2), dtype=x.dtype)
    # Looked up per call (not bound at import): the library loads later, and tests spy on the op.
    getattr(torch.ops.llm_cpu, op_name)(x2d, out)
    return out.view(*x.shape[:-1], out.shape[1])


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter_size, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    else:  # "gelu_tanh"
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # tanh is +-1 in float32 past +-15: no exp overflow.
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
        # tanh(y) = 2 sigmoid(2y) - 1: no tanh in every Triton backend (the interpreter included).
        act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    out = act * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul_triton(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The module's contract as one Triton kernel (the activation a constexpr)."""
    _op_name(activation)  # a ValueError for an unknown activation
    inter_size = x.shape[-1] // 2
    x2d = _rows(x)
    out = torch.empty((x2d.shape[0], inter_size), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(*x.shape[:-1], inter_size)
    block = min(1024, triton.next_power_of_2(inter_size))
    grid = (x2d.shape[0], triton.cdiv(inter_size, block))
    _act_and_mul_kernel[grid](
        x2d, out, x2d.stride(0), out.stride(0), inter_size, ACTIVATION=activation, BLOCK=block
    )
    return out.view(*x.shape[:-1], inter_size)


silu_and_mul_torch = functools.partial(act_and_mul_torch, activation="silu")
silu_and_mul_cpu = functools.partial(act_and_mul_cpu, activation="silu")
silu_and_mul_triton = functools.partial(act_and_mul_triton, activation="silu")
gelu_tanh_and_mul_torch = functools.partial(act_and_mul_torch, activation="gelu_tanh")
gelu_tanh_and_mul_cpu = functools.partial(act_and_mul_cpu, activation="gelu_tanh")
gelu_tanh_and_mul_triton = functools.partial(act_and_mul_triton, activation="gelu_tanh")
