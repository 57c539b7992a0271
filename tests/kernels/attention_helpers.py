"""Paged attention test cases and references, shared by test_paged_attention.py (Triton and torch
paths) and test_paged_attention_cpu.py (the C++ CPU op): the case shapes, random inputs over a
shuffled block pool, and a naive per-token float64 attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # including the new tokens
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: int | None = None


CASES = {
    # Contexts of exactly k*block_size, +1, -1, a single token, and 2 blocks.
    "decode-block-boundaries": Case((1, 1, 1, 1, 1), (16, 17, 15, 1, 32), 4, 4, 64, 16),
    "gqa4-d128": Case((1, 3, 1), (9, 20, 40), 8, 2, 128, 8),
    "mqa-gqa8-d80": Case((2, 1), (10, 25), 8, 1, 80, 8),
    "mixed-prefill-decode-d96": Case((7, 1, 12, 1), (7, 33, 12, 9), 4, 2, 96, 8),
    # Chunks after a cached prefix (prefix-cache hit / earlier chunk), crossing block boundaries.
    "prefix-cached-chunks": Case((5, 9), (37, 25), 4, 2, 64, 8),
    "sliding-window": Case((6, 1, 1, 11), (30, 20, 5, 11), 4, 2, 64, 8, sliding_window=8),
    # More new tokens than one query tile holds.
    "long-prefill": Case((70,), (70,), 4, 2, 64, 16),
    # Decodes whose context spans several KV splits (and one split left empty for the short one).
    "long-decode": Case((1, 1), (300, 45), 4, 1, 64, 16),
}


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    sliding_window: int | None

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
            self.sliding_window,
        )


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random contexts scattered over a shuffled block pool. Every slot outside a context holds
    large stale values, so attending to one would show."""
    blocks_per_seq = [math.ceil(n / case.block_size) for n in case.context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = (torch.randn(shape, device=device) * 300).to(dtype)
    v_cache = (torch.randn(shape, device=device) * 300).to(dtype)

    pool = torch.randperm(num_blocks).tolist()
    # Unused entries are -1 and one column wider than needed: never to be read.
    block_tables = torch.full(
        (len(case.context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32
    )
    for b, (context_len, n_blocks) in enumerate(
        zip(case.context_lens, blocks_per_seq, strict=True)
    ):
        block_tables[b, :n_blocks] = torch.tensor([pool.pop() for _ in range(n_blocks)])
        positions = torch.arange(context_len)
        blocks, offsets = (
            block_tables[b, positions // case.block_size].long(),
            positions % case.block_size,
        )
        k_cache[blocks, offsets] = (
            torch.randn(context_len, case.num_kv_heads, case.head_dim).to(dtype).to(device)
        )
        v_cache[blocks, offsets] = (
            torch.randn(context_len, case.num_kv_heads, case.head_dim).to(dtype).to(device)
        )

    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], case.num_heads, case.head_dim, device=device).to(dtype)
    return Inputs(
        q,
        k_cache,
        v_cache,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(case.context_lens, dtype=torch.int32, device=device),
        block_tables.to(device),
        1.0 / math.sqrt(case.head_dim),
        case.sliding_window,
    )


def naive_attention(inputs: Inputs, softcap: float | None = None) -> torch.Tensor:
    """Token by token in float64: gather the visible keys through the block table, softmax, sum
    (scores soft-capped first, tanh(s / softcap) * softcap, when `softcap` is set)."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    block_size, groups = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    starts, context_lens = inputs.query_start_loc.tolist(), inputs.seq_lens.tolist()
    for b, context_len in enumerate(context_lens):
        query_len = starts[b + 1] - starts[b]
        for i in range(query_len):
            pos = context_len - query_len + i
            first = 0 if inputs.sliding_window is None else max(0, pos - inputs.sliding_window + 1)
            keys_pos = torch.arange(first, pos + 1)
            blocks = inputs.block_tables[b].cpu()[keys_pos // block_size].long()
            keys = k_cache[blocks, keys_pos % block_size].double().repeat_interleave(groups, dim=1)
            values = (
                v_cache[blocks, keys_pos % block_size].double().repeat_interleave(groups, dim=1)
            )
            query = q[starts[b] + i].double()  # [Hq, D]
            scores = torch.einsum("hd,khd->hk", query, keys) * inputs.scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            weights = torch.softmax(scores, dim=-1)
            out[starts[b] + i] = torch.einsum("hk,khd->hd", weights, values)
    return out
