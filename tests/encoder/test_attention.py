"""Packed attention strategies against plain per-sequence attention in PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend_lib.encoder.attention import SHORT_SEQUENCE, PaddedAttention, RunAttention
from backend_lib.encoder.packed_tokens import pack

HEADS, HEAD_DIM = 4, 8


def reference(qkv: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out, start = [], 0
    for length in lengths:
        block = qkv[start : start + length].view(1, length, 3, HEADS, HEAD_DIM)
        q, k, v = (t.transpose(1, 2) for t in block.unbind(2))
        out.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(length, -1))
        start += length
    return torch.cat(out)


@pytest.mark.parametrize(
    "lengths",
    [
        [90, 90, 60, 60, 60, 47, 20, 20, 3, 1],  # planner order: long runs, then short ones
        [5, 100, 5, 7, 64, 64, 1, 48, 47],  # any order: short runs between long ones
        [12, 12, 12],  # one uniform short block
        [200],
    ],
)
@pytest.mark.parametrize("strategy", [RunAttention, PaddedAttention])
def test_packed_attention_equals_per_sequence_attention(lengths, strategy):
    torch.manual_seed(0)
    qkv = torch.randn(sum(lengths), 3 * HEADS * HEAD_DIM)
    tokens = pack([[1] * n for n in lengths], torch.device("cpu"))
    attention = strategy()
    got = attention(qkv, attention.prepare(tokens), HEADS)
    torch.testing.assert_close(got, reference(qkv, lengths), atol=1e-5, rtol=1e-5)


def test_short_runs_merge_into_one_masked_block():
    lengths = [100, 100, 60, 30, 30, 20, 2]
    blocks = RunAttention().prepare(pack([[1] * n for n in lengths], torch.device("cpu")))
    assert [(b.count, b.longest, b.padding is None) for b in blocks] == [
        (2, 100, True),
        (1, 60, True),
        (4, 30, False),
    ]
    assert all(n < SHORT_SEQUENCE for n in lengths[3:])
    assert blocks[-1].start == 260 and blocks[-1].tokens == 82
