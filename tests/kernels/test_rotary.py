"""Rotary embedding: the cos/sin cache against HF's rope init (default and llama3), application
against HF's apply_rotary_pos_emb, the Triton kernel against the torch reference."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rotary import apply_rotary_torch, apply_rotary_triton, rope_cos_sin_cache

HEAD_DIM = 64
MAX_POS = 512
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that with head_dim 64 the frequencies fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}


def _hf_rotary(theta: float, scaling: dict | None) -> LlamaRotaryEmbedding:
    params = (
        {"rope_type": "default", "rope_theta": theta}
        if scaling is None
        else {**scaling, "rope_theta": theta}
    )
    config = LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(config)


def _hf_cos_sin(theta: float, scaling: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = _hf_rotary(theta, scaling)
    cos, sin = rotary(torch.zeros(1, MAX_POS, HEAD_DIM), torch.arange(MAX_POS)[None])
    return cos[0], sin[0]  # [MAX_POS, HEAD_DIM], each half repeated


LEGACY_LLAMA3 = {**{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"}


@pytest.mark.parametrize(
    "theta,scaling,hf_scaling",
    [
        (10000.0, None, None),
        (10000.0, {"rope_type": "default"}, None),
        (500000.0, LLAMA3, LLAMA3),
        (500000.0, LEGACY_LLAMA3, LLAMA3),
    ],
    ids=["none", "default", "llama3", "llama3-legacy-type-key"],
)
def test_cache_matches_hf_rope_init(theta, scaling, hf_scaling):
    cache = rope_cos_sin_cache(HEAD_DIM, MAX_POS, theta, scaling, torch.float32, "cpu")
    cos, sin = _hf_cos_sin(theta, hf_scaling)
    assert cache.shape == (MAX_POS, HEAD_DIM)
    # Same float32 arithmetic as HF: bit-for-bit equal.
    assert torch.equal(cache[:, : HEAD_DIM // 2], cos[:, : HEAD_DIM // 2])
    assert torch.equal(cache[:, HEAD_DIM // 2 :], sin[:, : HEAD_DIM // 2])


def test_llama3_case_covers_all_frequency_bands():
    # Guards the test above: the llama3 parameters must hit the kept, scaled and blended bands.
    inv_freq = _hf_rotary(500000.0, LLAMA3).original_inv_freq
    wavelen = 2 * math.pi / inv_freq
    old = LLAMA3["original_max_position_embeddings"]
    assert (wavelen < old / LLAMA3["high_freq_factor"]).any()
    assert (wavelen > old / LLAMA3["low_freq_factor"]).any()
    assert (
        (wavelen >= old / LLAMA3["high_freq_factor"]) & (wavelen <= old / LLAMA3["low_freq_factor"])
    ).any()


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="yarn"):
        rope_cos_sin_cache(
            HEAD_DIM, 8, 10000.0, {"rope_type": "yarn", "factor": 2.0}, torch.float32, "cpu"
        )


def test_apply_rotary_torch_matches_hf(device):
    cache = rope_cos_sin_cache(HEAD_DIM, MAX_POS, 500000.0, LLAMA3, torch.float32, device)
    cos, sin = _hf_cos_sin(500000.0, LLAMA3)
    positions = torch.tensor([0, 3, 511, 64, 65, 7], device=device)
    q = torch.randn(6, 4, HEAD_DIM, device=device)
    k = torch.randn(6, 2, HEAD_DIM, device=device)
    # HF layout: [batch, heads, seq, dim] with cos/sin [batch, seq, dim].
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        cos[positions.cpu()].to(device)[None],
        sin[positions.cpu()].to(device)[None],
    )
    got_q, got_k = apply_rotary_torch(positions, q, k, cache)
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def _rotate_naive(positions, x, cache, rotary_dim):
    """Per token, per pair: (x_i, x_{i+half}) rotated by angle_i of the token's position."""
    out = x.double().clone()
    half = rotary_dim // 2
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            c, s = cache[pos, i].double(), cache[pos, half + i].double()
            a, b = x[t, :, i].double(), x[t, :, half + i].double()
            out[t, :, i], out[t, :, half + i] = a * c - b * s, b * c + a * s
    return out


def test_apply_rotary_torch_partial_rotary_matches_naive(device):
    # rotary_dim 32 < head_dim 64: only the first 32 dims rotate, the rest pass through.
    cache = rope_cos_sin_cache(32, 100, 10000.0, None, torch.float32, device)
    positions = torch.tensor([5, 0, 99], device=device)
    q, k = torch.randn(3, 2, 64, device=device), torch.randn(3, 1, 64, device=device)
    got_q, got_k = apply_rotary_torch(positions, q, k, cache)
    torch.testing.assert_close(got_q.double(), _rotate_naive(positions, q, cache, 32))
    torch.testing.assert_close(got_k.double(), _rotate_naive(positions, k, cache, 32))


@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim,rotary_dim",
    [(1, 4, 4, 64, 64), (7, 8, 2, 128, 128), (5, 6, 1, 80, 80), (4, 4, 2, 96, 48)],
)
def test_triton_matches_torch(
    device,
    dtype,
    num_tokens,
    num_heads,
    num_kv_heads,
    head_dim,
    rotary_dim,
    run_poisoned,
    assert_close,
):
    cache = rope_cos_sin_cache(rotary_dim, 300, 10000.0, None, torch.float32, device)
    positions = torch.randint(0, 300, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    q_before, k_before = q.clone(), k.clone()
    got_q, got_k = run_poisoned(apply_rotary_triton, positions, q, k, cache)
    want_q, want_k = apply_rotary_torch(positions, q, k, cache)
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched


def test_triton_reads_strided_qkv_views(device, run_poisoned, assert_close):
    # q and k as views into one fused qkv projection output.
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    cache = rope_cos_sin_cache(head_dim, 64, 10000.0, None, torch.float32, device)
    positions = torch.randint(0, 64, (num_tokens,), device=device)
    got_q, got_k = run_poisoned(apply_rotary_triton, positions, q, k, cache)
    want_q, want_k = apply_rotary_torch(positions, q, k, cache)
    assert_close(got_q, want_q, torch.float32)
    assert_close(got_k, want_k, torch.float32)
