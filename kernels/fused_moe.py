"""Mixture-of-experts MLP: routing, tokens sorted by expert into block-aligned segments, and a
grouped GEMM over those segments (the fused MoE of vLLM and SGLang, written afresh here).

Contract (both backends): `fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)` ->
[N, H] in x's dtype, with, for each token n,
`out[n] = sum_j topk_weights[n, j] * down_e(silu(gate_e(x[n])) * up_e(x[n]))`, e = topk_ids[n, j],
`gate_e(x) = x @ w_gate_up[e, :I].T`, `up_e(x) = x @ w_gate_up[e, I:].T`,
`down_e(h) = h @ w_down[e].T`. x [N, H]; w_gate_up [E, 2I, H] and w_down [E, H, I] of x's dtype
and device (the experts' fused gate/up and down projections, as transformers 5 holds them);
topk_weights [N, k] float32; topk_ids [N, k] integer in [0, E). The weighted sum over the k
experts is taken in float32.

- `moe_route`: router logits -> (top-k weights, expert ids), as transformers computes them
  (softmax in float32, then top-k, then optionally renormalised over the k).
- `moe_align_block_size`: the k * N (token, slot) pairs sorted by expert into segments padded
  to a multiple of the GEMM's row block, and the expert of each row block; on the device,
  without a host sync (the segments' total is bounded, blocks past it are marked -1).
- PyTorch path (`fused_moe_torch`, and `grouped_moe` that the CPU engine calls with its packed
  or int8 expert linears): each expert runs once over all its tokens (rows gathered with
  index_select, results weighted and scattered back with index_add), experts without tokens
  skipped; never one token at a time.
- Triton path (`fused_moe_triton`): two launches of one grouped GEMM kernel, one program per
  (row block, column block): gate/up with SiLU-and-mul fused into the epilogue, then down with
  the routing weight applied in the epilogue; accumulating in float32. The [k*N, I]
  intermediate is kept in x's dtype (like the twin's), the down outputs in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_torch

Projection = Callable[[torch.Tensor], torch.Tensor]
ExpertCalls = tuple[Projection, Projection]
"""One expert as (gate_up: [n, H] -> [n, 2I], down: [n, I] -> [n, H])."""


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights float32 [N, k], expert ids int64 [N, k]): softmax over the
    experts in float32, the k largest (torch.topk's order and tie-breaking, as transformers),
    divided by their sum when `renormalize` (Mixtral, Qwen-MoE's `norm_topk_prob`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class MoEBlocks:
    """The (token, slot) pairs of a batch sorted by expert into block-aligned segments."""

    sorted_ids: torch.Tensor
    """int32 [num_blocks * block_m]: flat pair index n * k + j, grouped by expert (ascending,
    pairs of an expert in flat order), each expert's run padded with the sentinel N * k to a
    multiple of block_m; the tail past the last segment is sentinel too."""
    block_expert: torch.Tensor
    """int32 [num_blocks]: the expert of each row block; -1 for blocks past the last segment."""
    block_m: int
    num_pairs: int
    """N * k (the sentinel)."""


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEBlocks:
    """Sort `topk_ids` [N, k]'s pairs by expert into segments padded to `block_m` rows (see
    `MoEBlocks`). Device ops only: the buffers are sized by the bound
    sum_e ceil(c_e / block_m) <= (N*k + min(E, N*k) * (block_m - 1)) // block_m."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    max_blocks = (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m
    # Not bincount: on CUDA it reads the ids' max back to the host (no CUDA-graph capture then).
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[sorted_expert]
    sorted_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_expert] + rank] = order.to(torch.int32)
    block_end = padded_end // block_m
    block_expert = torch.searchsorted(
        block_end, torch.arange(max_blocks, device=device), right=True
    )
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoEBlocks(sorted_ids, block_expert, block_m, pairs)


def grouped_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: Sequence[ExpertCalls],
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The contract's result with each expert given as its two projections (any callables: the
    CPU engine's oneDNN-packed or int8 linears). The rows are gathered once in expert order; each
    expert with tokens runs once over its contiguous slice of them; the outputs are weighted and
    scattered back in one index_add. One host sync (the per-expert counts)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros((0, x.shape[1]))
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tokens = order // top_k if top_k > 1 else order
    gathered = x.index_select(0, tokens)
    outputs = []
    start = 0
    for (gate_up, down), count in zip(experts, counts, strict=True):
        if count:
            outputs.append(down(silu_and_mul(gate_up(gathered[start : start + count]))))
            start += count
    hidden = (torch.cat(outputs) if len(outputs) > 1 else outputs[0]).float()
    hidden = hidden * topk_weights.reshape(-1).float().index_select(0, order).unsqueeze(1)
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, hidden).to(x.dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """PyTorch version (the reference and CPU path): `grouped_moe` over the stacked weights."""
    experts = [
        (lambda h, w=w_gate_up[e]: F.linear(h, w), lambda h, w=w_down[e]: F.linear(h, w))
        for e in range(w_gate_up.shape[0])
    ]
    return grouped_moe(x, topk_weights, topk_ids, experts, silu_and_mul_torch)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    A_ROW_DIV: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out[pair] = a[row(pair)] @ W[expert].T (N columns; with
    FUSE_SILU, silu(a @ W[:N].T) * (a @ W[N:2N].T)), times the pair's routing weight with
    MUL_WEIGHT. Rows are the pairs of one row block of `sorted_ids`, all of one expert."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV  # the token of a pair (x's row), or the pair itself
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = col_mask[None, :] & k_mask[:, None]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if FUSE_SILU:
            w_up = tl.load(
                w_base + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask, other=0.0
            )
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if FUSE_SILU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_out + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    blocks: MoEBlocks,
    weights: torch.Tensor,
    top_k: int,
    a_per_token: bool,
    fuse_silu: bool,
    mul_weight: bool,
) -> None:
    n = out.shape[1]
    k = a.shape[1]
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (blocks.block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        blocks.sorted_ids,
        blocks.block_expert,
        weights,
        blocks.num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROW_DIV=top_k if a_per_token else 1,
        FUSE_SILU=fuse_silu,
        MUL_WEIGHT=mul_weight,
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """Triton version of `fused_moe_torch` (same contract): align the pairs by expert, then the
    gate/up GEMM with SiLU-and-mul fused, then the down GEMM weighted, then the sum over k."""
    num_tokens, top_k = topk_ids.shape
    hidden = w_down.shape[1]
    inter = w_down.shape[2]
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    x = x if x.stride(1) == 1 else x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    blocks = moe_align_block_size(topk_ids, w_gate_up.shape[0], block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    activated = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _moe_gemm(x, w_gate_up, activated, blocks, weights, top_k, True, True, False)
    down = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    _moe_gemm(activated, w_down, down, blocks, weights, top_k, False, False, True)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
