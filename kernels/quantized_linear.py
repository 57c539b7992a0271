"""Weight-only quantized linear (int8 or fp8 weights, per-output-channel scales): the GPU path
of `quantization: int8` / `fp8` (backend_lib/quantization.py).

Contract (both versions): `quantized_linear(x, qweight, scale, bias=None)` returns
`x @ (qweight * scale[:, None]).T + bias` in `x`'s dtype, for `x` [M, K] (float32, float16 or
bfloat16), `qweight` [N, K] (torch.int8, or torch.float8_e4m3fn on CUDA), `scale` [N] float32
(one per output row, so it factors out of the dot product: the kernel scales the float32
accumulator, which is the same as dequantizing every weight first), `bias` [N] or None (any
float dtype). Products are accumulated in float32; the result is rounded to `x`'s dtype once.
Activations are never quantized (weight-only).

PyTorch twin (`quantized_linear_torch`): the dequantized matmul in float32 — the reference, and
the fallback wherever neither the Triton kernel nor the CPU fast path applies.
Triton kernel (`quantized_linear_triton`): one program per [BLOCK_M, BLOCK_N] output tile; each
K step loads an x tile and a weight tile, converts the weights to x's dtype in registers (int8
values and e4m3 values are exact in float16/bfloat16/float32), `tl.dot` into a float32
accumulator, then scales the columns, adds the bias and stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def quantized_linear_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract in plain PyTorch: float32 matmul on the quantized values, then the per-row
    scale and the bias, rounded to x's dtype."""
    y = F.linear(x.float(), qweight.float()) * scale.float()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


@triton.jit
def _quantized_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(  # [BLOCK_K, BLOCK_N]: W.T, still quantized (fp8 as its raw bytes)
            w_ptr + cols64[None, :] * stride_w + ks[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0,
        )
        if WEIGHT_FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows64[:, None] * stride_out + cols64[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def quantized_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of `quantized_linear_torch` (same contract)."""
    assert x.dim() == 2 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight.contiguous()
    fp8 = qweight.dtype == torch.float8_e4m3fn
    if fp8:  # loaded as bytes, reinterpreted in the kernel
        qweight = qweight.view(torch.uint8)
    scale = scale.float().contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 64
    _quantized_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scale,
        bias if bias is not None else scale,  # never read without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        WEIGHT_FP8=fp8,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
