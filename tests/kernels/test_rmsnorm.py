"""rms_norm: the torch reference against HF LlamaRMSNorm, the Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rmsnorm import rms_norm_torch, rms_norm_triton

EPS = 1e-6


def _hf_norm(weight: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(weight.shape[0], eps=EPS).to(weight.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@torch.no_grad()
def test_torch_reference_matches_hf_llama_rmsnorm(device):
    x = torch.randn(6, 96, device=device) * 4
    weight = torch.randn(96, device=device)
    torch.testing.assert_close(
        rms_norm_torch(x, weight, EPS), _hf_norm(weight)(x), rtol=1e-6, atol=1e-6
    )


@torch.no_grad()
def test_torch_reference_fused_residual_matches_hf_decoder_add(device):
    # HF Llama: hidden = residual + hidden; residual = hidden; hidden = norm(hidden).
    x, residual = torch.randn(5, 64, device=device), torch.randn(5, 64, device=device)
    weight = torch.randn(64, device=device)
    normed, summed = rms_norm_torch(x, weight, EPS, residual)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, _hf_norm(weight)(x + residual), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 80), (3, 1000)])
def test_triton_matches_torch(device, dtype, rows, hidden, run_poisoned, assert_close):
    x = (torch.randn(rows, hidden, device=device) * 2).to(dtype)
    weight = torch.randn(hidden, device=device).to(dtype)
    assert_close(
        run_poisoned(rms_norm_triton, x, weight, EPS), rms_norm_torch(x, weight, EPS), dtype
    )


@pytest.mark.parametrize("rows,hidden", [(1, 64), (9, 96)])
def test_triton_fused_residual_matches_torch(
    device, dtype, rows, hidden, run_poisoned, assert_close
):
    x = torch.randn(rows, hidden, device=device).to(dtype)
    residual = torch.randn(rows, hidden, device=device).to(dtype)
    weight = torch.randn(hidden, device=device).to(dtype)
    normed, summed = run_poisoned(rms_norm_triton, x, weight, EPS, residual)
    want_normed, want_summed = rms_norm_torch(x, weight, EPS, residual)
    assert torch.equal(summed, want_summed)  # one correctly rounded add in both
    assert_close(normed, want_normed, dtype)


def test_triton_per_head_qk_norm(device, run_poisoned, assert_close):
    # Qwen3 q/k norm: [T, heads, head_dim] normalised per head; a non-contiguous head view.
    qkv = torch.randn(4, 3, 2, 64, device=device)
    q = qkv[:, 0]
    weight = torch.randn(64, device=device)
    got = run_poisoned(rms_norm_triton, q, weight, EPS)
    assert got.shape == q.shape
    assert_close(got, rms_norm_torch(q, weight, EPS), torch.float32)
