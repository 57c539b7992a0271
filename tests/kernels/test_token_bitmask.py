"""apply_token_bitmask: the torch version against a bit-by-bit reference (bits packed here with
numpy, independently of the kernels) and against xgrammar's own applier; the Triton kernel against
the torch version (bit-exact: masking moves no values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import kernel_ops
from kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V/32)] int32, bit t % 32 of word t // 32 (little-endian bits)."""
    b, v = allowed.shape
    words = -(-v // 32)
    padded = np.zeros((b, words * 32), dtype=bool)
    padded[:, :v] = allowed
    bits = padded.reshape(b, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return torch.from_numpy(bits.sum(axis=-1).astype(np.uint32).view(np.int32))


def _case(num_rows: int, vocab: int, rows: list[int], density: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    allowed = rng.random((len(rows), vocab)) < density
    logits = torch.from_numpy(rng.standard_normal((num_rows, vocab)).astype(np.float32))
    return logits, allowed, torch.tensor(rows, dtype=torch.int64)


def _reference(logits: torch.Tensor, allowed: np.ndarray, rows: list[int]) -> torch.Tensor:
    want = logits.clone()
    for b, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not allowed[b, t]:
                want[r, t] = float("-inf")
    return want


@pytest.mark.parametrize(
    "num_rows,vocab,rows",
    [(1, 32, [0]), (4, 100, [0, 2]), (5, 1500, [4, 1, 3]), (3, 64, [])],
)
def test_torch_matches_bitwise_reference(num_rows, vocab, rows):
    # 100 and 1500: a partial last word; [] leaves every row alone.
    logits, allowed, rows_t = _case(num_rows, vocab, rows, density=0.3)
    want = _reference(logits, allowed, rows)
    apply_token_bitmask_torch(logits, _pack(allowed), rows_t)
    assert torch.equal(logits, want)


def test_torch_matches_xgrammar_applier():
    xgr = pytest.importorskip("xgrammar")
    logits, allowed, _ = _case(6, 4099, list(range(6)), density=0.5, seed=3)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, _pack(allowed))
    apply_token_bitmask_torch(logits, _pack(allowed), torch.arange(6))
    assert torch.equal(logits, want)


def test_bits_past_vocab_are_ignored():
    logits, allowed, rows = _case(2, 40, [1], density=1.0)
    bitmask = _pack(allowed)
    bitmask[:, 1] = 0xFF  # tokens 32-39 allowed, 40-63 (past the vocabulary) junk
    want = logits.clone()
    want[1, 8:32] = float("-inf")
    bitmask[0, 0] = 0xFF  # tokens 0-7 only in word 0
    apply_token_bitmask_torch(logits, bitmask, rows)
    assert torch.equal(logits, want)


@pytest.mark.parametrize(
    "num_rows,vocab,rows", [(1, 32, [0]), (4, 100, [3, 0]), (3, 2500, [1, 2, 0])]
)
def test_triton_matches_torch(device, dtype, num_rows, vocab, rows):
    # 2500 > the 1024-token block: several programs per row, a masked tail.
    logits, allowed, rows_t = _case(num_rows, vocab, rows, density=0.4, seed=vocab)
    logits, bitmask, rows_t = logits.to(device, dtype), _pack(allowed).to(device), rows_t.to(device)
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask, rows_t)
    apply_token_bitmask_triton(logits, bitmask, rows_t)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[rows_t]).sum() == int((~allowed).sum())


def test_kernel_ops_carry_the_bitmask_kernels():
    assert kernel_ops("torch").apply_token_bitmask is apply_token_bitmask_torch
    assert kernel_ops("triton").apply_token_bitmask is apply_token_bitmask_triton
