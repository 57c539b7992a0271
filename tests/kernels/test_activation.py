"""silu_and_mul: the torch reference against a float64 formula, the Triton kernel against the
reference; every entry of the act_and_mul contract refuses an unknown activation (GELU(tanh):
tests/kernels/test_gemma_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import (
    act_and_mul_cpu,
    act_and_mul_torch,
    act_and_mul_triton,
    silu_and_mul_torch,
    silu_and_mul_triton,
)


def _silu_and_mul_float64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    gate, up = x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :]
    return gate / (1.0 + torch.exp(-gate)) * up


def test_torch_reference_matches_formula(device):
    x = torch.randn(7, 2 * 40, device=device) * 3
    got = silu_and_mul_torch(x)
    assert got.shape == (7, 40)
    torch.testing.assert_close(got.double(), _silu_and_mul_float64(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens,inter_size", [(1, 64), (5, 100), (3, 1500)])
def test_triton_matches_torch(device, dtype, num_tokens, inter_size, run_poisoned, assert_close):
    # 1500 > the 1024-wide block: exercises the second grid axis and its masked tail.
    x = (torch.randn(num_tokens, 2 * inter_size, device=device) * 3).to(dtype)
    got = run_poisoned(silu_and_mul_triton, x)
    assert_close(got, silu_and_mul_torch(x), dtype)


def test_triton_accepts_strided_rows(device, run_poisoned, assert_close):
    # A row-strided view (a column slice of a wider buffer), as a fused projection would hand over.
    wide = torch.randn(4, 2 * 48 + 16, device=device)
    x = wide[:, : 2 * 48]
    assert_close(run_poisoned(silu_and_mul_triton, x), silu_and_mul_torch(x), torch.float32)


@pytest.mark.parametrize("entry", [act_and_mul_torch, act_and_mul_triton, act_and_mul_cpu])
def test_unknown_activation_is_refused(entry, device):
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        entry(torch.randn(2, 8, device=device), "relu")
