"""Bidirectional self-attention over packed sequences: each sequence attends to itself.

Both strategies take the fused projection `qkv` [T, 3 * heads * head_dim] of a
micro-batch and return the context [T, heads * head_dim]. `prepare` runs once per
micro-batch; its result is shared by every layer.

- `RunAttention` (CPU): one unmasked attention per run of equal-length sequences, so no
  padded position is computed and no mask is read. Runs of short sequences are merged
  into one masked block instead: their attention is cheap, and many tiny calls would
  cost more in per-call overhead (and in thread synchronisation on a busy machine).
- `PaddedAttention` (GPU): one masked attention over the micro-batch scattered into
  [B, longest]. A constant number of kernels per layer; launching one per run would cost
  more than the few padded positions of a length-sorted micro-batch.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend_lib.encoder.packed_tokens import PackedTokens

# Below this length one matmul-softmax-matmul beats the fused CPU attention kernel, whose
# per-block overhead dominates tiny sequences (measured on AVX-512, head_dim 32).
SHORT_SEQUENCE = 48


@dataclass
class Padding:
    """Where the tokens of several sequences go in a [count, longest] padded view."""

    positions: torch.Tensor  # [tokens] row of each token in the flattened [count * longest] view
    key_mask: torch.Tensor  # [count, 1, 1, longest] bool, True at real tokens

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Padding:
        longest = max(lengths)
        lengths_t = torch.tensor(lengths, device=device)
        columns = torch.arange(longest, device=device)
        mask = columns[None, :] < lengths_t[:, None]
        rows = torch.arange(len(lengths) * longest, device=device).view(len(lengths), longest)
        return cls(positions=rows[mask], key_mask=mask[:, None, None, :])


@dataclass
class Block:
    """Consecutive sequences attended together: tokens [start, start + tokens)."""

    start: int
    tokens: int
    count: int
    longest: int
    padding: Padding | None  # None when every sequence has `longest` tokens


def _heads_view(flat: torch.Tensor, count: int, length: int, heads: int):
    """[count * length, 3 * H] -> q, k, v as [count, heads, length, head_dim] views."""
    head_dim = flat.shape[1] // (3 * heads)
    block = flat.view(count, length, 3, heads, head_dim)
    return (t.transpose(1, 2) for t in block.unbind(2))


def _attend(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    if q.device.type == "cpu" and q.shape[2] < SHORT_SEQUENCE:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _padded_attention(flat: torch.Tensor, padding: Padding, heads: int) -> torch.Tensor:
    count, longest = padding.key_mask.shape[0], padding.key_mask.shape[-1]
    padded = flat.new_zeros(count * longest, flat.shape[1])
    padded[padding.positions] = flat
    out = _attend(*_heads_view(padded, count, longest, heads), padding.key_mask)
    return out.transpose(1, 2).reshape(count * longest, -1)[padding.positions]


class RunAttention:
    """Per-run attention (see module docstring)."""

    def prepare(self, tokens: PackedTokens) -> list[Block]:
        device = tokens.input_ids.device
        blocks: list[Block] = []
        start, short = 0, []  # short: lengths of the pending consecutive short sequences

        def add(lengths: list[int]) -> None:
            nonlocal start
            uniform = len(set(lengths)) == 1
            padding = None if uniform else Padding.of(lengths, device)
            blocks.append(Block(start, sum(lengths), len(lengths), max(lengths), padding))
            start += sum(lengths)

        for length, group in itertools.groupby(tokens.lengths):
            lengths = [length] * len(list(group))
            if length < SHORT_SEQUENCE:
                short += lengths
                continue
            if short:
                add(short)
                short = []
            add(lengths)
        if short:
            add(short)
        return blocks

    def __call__(self, qkv: torch.Tensor, blocks: list[Block], heads: int) -> torch.Tensor:
        context = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)
        for b in blocks:
            flat = qkv[b.start : b.start + b.tokens]
            if b.padding is None:
                out = _attend(*_heads_view(flat, b.count, b.longest, heads), None)
                context[b.start : b.start + b.tokens].view(b.count, b.longest, heads, -1).copy_(
                    out.transpose(1, 2)
                )
            else:
                context[b.start : b.start + b.tokens] = _padded_attention(flat, b.padding, heads)
        return context


class PaddedAttention:
    """One masked attention per micro-batch (see module docstring)."""

    def prepare(self, tokens: PackedTokens) -> Padding:
        return Padding.of(tokens.lengths, tokens.input_ids.device)

    def __call__(self, qkv: torch.Tensor, padding: Padding, heads: int) -> torch.Tensor:
        return _padded_attention(qkv, padding, heads)
