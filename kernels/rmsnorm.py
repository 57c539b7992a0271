"""RMSNorm with an optional fused residual add (Llama decoder layers; also Qwen3's per-head q/k norm)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cpu_extension


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise the last dim of x and scale by weight, in float32; returns x's dtype.

    With `residual`, first s = x + residual (added in x's dtype, as HF Llama does) and returns
    (rms_norm(s) * weight, s), so the caller carries s on as the next residual.
    """
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_torch`'s contract, the "torch" backend's entry: the C++ op (one pass per row,
    kernels/csrc/elementwise_cpu.cpp) on tensors it takes, else the twin. Same bits as the twin
    but for the summation order of the mean of squares."""
    if not cpu_extension.takes(x) or (residual is not None and residual.dtype != x.dtype):
        return rms_norm_torch(x, weight, eps, residual)
    x2d = _rows(x)
    out = torch.empty_like(x2d)
    if residual is None:
        torch.ops.llm_cpu.rms_norm(x2d, weight, eps, None, out, out)
        return out.view(x.shape)
    summed = torch.empty_like(out)
    torch.ops.llm_cpu.rms_norm(x2d, weight, eps, _rows(residual), out, summed)
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_sum,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole row fits in one block (hidden sizes are at most a few thousand).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to x's dtype before normalising, exactly like the eager residual add.
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols,
        (xf * inv_rms * weight).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, hidden] with unit stride along hidden (copies only when it must)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_torch` (same contract; x may have any leading dims)."""
    x2d = _rows(x)
    hidden_size = x2d.shape[1]
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    res2d = _rows(residual) if residual is not None else x2d
    summed = torch.empty_like(out) if residual is not None else out
    if x2d.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(x2d.shape[0],)](
            x2d,
            res2d,
            weight,
            out,
            summed,
            x2d.stride(0),
            res2d.stride(0),
            out.stride(0),
            summed.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, summed.view(x.shape))
