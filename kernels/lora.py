"""Batched multi-LoRA (Punica / SGMV style): each row of a flattened batch adds the low-rank delta
of its own adapter to a projection's output, every adapter of the step in one call.

Contract (both backends): `add_lora(out, x, lora_a, lora_b, segments)`, in place on `out` [T, N]:
for each segment (start, end, slot) of `segments`,
`out[start:end] += (x[start:end] @ lora_a[slot].T) @ lora_b[slot].T`; rows in no segment (the base
model's) are left unchanged. `x` [T, K], `lora_a` [S, R, K] (shrink), `lora_b` [S, N, R] (expand,
the adapter's scaling folded in), all of `out`'s dtype (float32, float16 or bfloat16) and device;
S is the number of adapter slots, R the slots' (padded) rank. Rows of one segment are contiguous
and share one slot; the runner orders a step's rows by slot so there are few segments.

PyTorch path (CPU): one shrink and one expand GEMM per segment, on slices (no gather).
Triton path: two kernels, shrink then expand, each one program per (segment, block of rows, block
of output columns), accumulating in float32; the shrink's [T, R] intermediate stays float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class LoRASegments:
    """Runs of consecutive rows that use the same adapter slot (base rows belong to none)."""

    bounds: tuple[tuple[int, int, int], ...]
    """(start row, end row (exclusive), slot) of each segment, on the host (the PyTorch path)."""
    starts: torch.Tensor
    """[G] int32 on device: first row of each segment (the Triton path)."""
    ends: torch.Tensor
    """[G] int32 on device: one past the last row of each segment."""
    slots: torch.Tensor
    """[G] int32 on device: the adapter slot of each segment."""
    max_rows: int
    """Rows of the longest segment."""


def lora_segments(
    slots: Sequence[int], device: torch.device, lengths: Sequence[int] | None = None
) -> LoRASegments | None:
    """Segments of a batch made of runs of `lengths[i]` rows (default 1) using slot `slots[i]`
    (-1: base model, no adapter); neighbouring runs of one slot merge. None when no row uses an
    adapter."""
    lengths = [1] * len(slots) if lengths is None else lengths
    bounds: list[tuple[int, int, int]] = []
    row = 0
    for slot, length in zip(slots, lengths, strict=True):
        if slot >= 0 and length > 0:
            if bounds and bounds[-1][1] == row and bounds[-1][2] == slot:
                bounds[-1] = (bounds[-1][0], row + length, slot)
            else:
                bounds.append((row, row + length, int(slot)))
        row += length
    if not bounds:
        return None
    table = torch.tensor(bounds, dtype=torch.int32).T.contiguous().to(device)
    return LoRASegments(
        tuple(bounds), table[0], table[1], table[2], max(end - begin for begin, end, _ in bounds)
    )


def add_lora_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """PyTorch version (the CPU path): a shrink and an expand GEMM per segment."""
    for start, end, slot in segments.bounds:
        out[start:end].addmm_(x[start:end] @ lora_a[slot].T, lora_b[slot].T)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    starts_ptr,
    ends_ptr,
    slots_ptr,
    K,
    R,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    end = tl.load(ends_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < R
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * stride_x + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(  # [BLOCK_K, BLOCK_R]: A[slot].T
            a_ptr + slot * stride_a_slot + ranks[None, :] * stride_a_rank + ks[:, None],
            mask=rank_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    tl.store(
        y_ptr + rows64[:, None] * stride_y + ranks[None, :],
        acc,
        mask=row_mask[:, None] & rank_mask[None, :],
    )


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    starts_ptr,
    ends_ptr,
    slots_ptr,
    N,
    R,
    stride_y,
    stride_b_slot,
    stride_b_col,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    end = tl.load(ends_ptr + g)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_mask = ranks < R
        y = tl.load(
            y_ptr + rows64[:, None] * stride_y + ranks[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )
        b = tl.load(  # [BLOCK_R, BLOCK_N]: B[slot].T
            b_ptr + slot * stride_b_slot + cols[None, :] * stride_b_col + ranks[:, None],
            mask=col_mask[None, :] & rank_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(y, b, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + rows64[:, None] * stride_out + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
) -> None:
    """Triton version of `add_lora_torch` (same contract): shrink into a float32 [T, R] buffer,
    then expand into `out`."""
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    num_segments = segments.starts.numel()
    rank, k = lora_a.shape[1], lora_a.shape[2]
    n = lora_b.shape[1]
    # Only segment rows of the buffer are written, and only they are read back.
    y = torch.empty((x.shape[0], rank), dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    block_m = 16
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    row_blocks = triton.cdiv(segments.max_rows, block_m)
    _lora_shrink_kernel[(num_segments, row_blocks, triton.cdiv(rank, block_r))](
        x,
        lora_a,
        y,
        segments.starts,
        segments.ends,
        segments.slots,
        k,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=32,
        DOT_PRECISION=precision,
    )
    block_n = 64
    _lora_expand_kernel[(num_segments, row_blocks, triton.cdiv(n, block_n))](
        y,
        lora_b,
        out,
        segments.starts,
        segments.ends,
        segments.slots,
        n,
        rank,
        y.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        DOT_PRECISION="ieee",
    )
