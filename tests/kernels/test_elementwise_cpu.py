"""The C++ CPU RMSNorm, rotary and SiLU-and-mul (kernels/csrc/elementwise_cpu.cpp) through the "torch"
backend's entries (rms_norm_cpu, apply_rotary_cpu, silu_and_mul_cpu): against transformers' modules
and a float64 formula, against the PyTorch twins (bit for bit where the contract says so), on strided
views as the model hands them over, refusing bad positions, and falling back to the twins when the
library is not loaded. Each test spies on the op, so a silent fallback fails.

Tolerances (relative, conftest.TOLERANCE): float32 1e-5, float16 2e-3, bfloat16 1.6e-2; against
transformers in float32 1e-6 absolute and relative, as the twins' own tests.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kernels import cpu_extension
from kernels.activation import silu_and_mul_cpu, silu_and_mul_torch
from kernels.rmsnorm import rms_norm_cpu, rms_norm_torch
from kernels.rotary import apply_rotary_cpu, apply_rotary_torch, rope_cos_sin_cache

# Not `dtype`: tests/kernels/conftest.py parametrizes that name itself (bfloat16 skipped on CPU, where
# only Triton's interpreter mishandles it).
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]
EPS = 1e-6


@pytest.fixture
def calls(cpu_kernels, monkeypatch) -> list[str]:
    """Names of the llm_cpu elementwise ops called during the test."""
    called: list[str] = []
    for name in ("rms_norm", "rotary", "silu_and_mul"):
        real = getattr(cpu_kernels, name)

        def spy(*args, _real=real, _name=name):
            called.append(_name)
            return _real(*args)

        monkeypatch.setattr(cpu_kernels, name, spy)
    return called


# --- RMSNorm -------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 80), (3, 1000), (33, 515)])
def test_rms_norm_matches_hf_llama_rmsnorm(calls, rows, hidden):
    x, residual = torch.randn(rows, hidden) * 4, torch.randn(rows, hidden)
    norm = LlamaRMSNorm(hidden, eps=EPS)
    norm.weight.copy_(torch.randn(hidden))
    torch.testing.assert_close(rms_norm_cpu(x, norm.weight, EPS), norm(x), rtol=1e-6, atol=1e-6)
    normed, summed = rms_norm_cpu(x, norm.weight, EPS, residual)
    assert torch.equal(summed, x + residual)  # HF: hidden = residual + hidden, one rounded add
    torch.testing.assert_close(normed, norm(x + residual), rtol=1e-6, atol=1e-6)
    assert calls == ["rms_norm", "rms_norm"]


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (9, 96), (70, 1003)])
def test_rms_norm_matches_the_twin(calls, assert_close, cpu_dtype, rows, hidden):
    x = (torch.randn(rows, hidden) * 2).to(cpu_dtype)
    residual = torch.randn(rows, hidden).to(cpu_dtype)
    weight = torch.randn(hidden).to(cpu_dtype)
    assert_close(rms_norm_cpu(x, weight, EPS), rms_norm_torch(x, weight, EPS), cpu_dtype)
    normed, summed = rms_norm_cpu(x, weight, EPS, residual)
    want_normed, want_summed = rms_norm_torch(x, weight, EPS, residual)
    assert torch.equal(summed, want_summed)
    assert_close(normed, want_normed, cpu_dtype)
    assert calls == ["rms_norm", "rms_norm"]


def test_rms_norm_per_head_view(calls, assert_close):
    # Qwen3's q/k norm: [T, heads, head_dim] normalised per head, on a non-contiguous head view.
    qkv = torch.randn(4, 3, 2, 64)
    q = qkv[:, 0]
    weight = torch.randn(64)
    got = rms_norm_cpu(q, weight, EPS)
    assert got.shape == q.shape
    assert_close(got, rms_norm_torch(q, weight, EPS), torch.float32)
    assert calls == ["rms_norm"]


# --- Rotary --------------------------------------------------------------------------------------


def _fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q [T, heads, D] and k [T, kv_heads, D]: strided views of one fused projection's output, as
    the model splits it."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rotary_dim", [64, 32, 20], ids=["full", "half", "partial-tail"])
def test_rotary_equals_the_twin(calls, cpu_dtype, rotary_dim):
    # Same float32 products and sums as the twin, no contraction: equal bits, strided views in.
    q, k = _fused_qkv(23, 8, 2, 64, cpu_dtype)
    cache = rope_cos_sin_cache(rotary_dim, 512, 10000.0, None, torch.float32, "cpu")
    positions = torch.randint(0, 512, (23,))
    got_q, got_k = apply_rotary_cpu(positions, q, k, cache)
    want_q, want_k = apply_rotary_torch(positions, q, k, cache)
    assert got_q.dtype == cpu_dtype and got_k.dtype == cpu_dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert calls == ["rotary"]


def test_rotary_matches_hf_apply_rotary_pos_emb(calls):
    q, k = _fused_qkv(12, 4, 2, 64, torch.float32)
    cache = rope_cos_sin_cache(64, 256, 500000.0, None, torch.float32, "cpu")
    positions = torch.randperm(256)[:12]
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    # HF wants [batch, heads, T, D] and cos/sin [batch, T, D].
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    got_q, got_k = apply_rotary_cpu(positions, q, k, cache)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert calls == ["rotary"]


def test_rotary_refuses_positions_outside_the_cache(cpu_kernels):
    q, k = _fused_qkv(3, 4, 2, 32, torch.float32)
    cache = rope_cos_sin_cache(32, 16, 10000.0, None, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 16 outside the cache's 16 positions"):
        apply_rotary_cpu(torch.tensor([0, 16, 2]), q, k, cache)


# --- SiLU-and-mul --------------------------------------------------------------------------------


def test_silu_and_mul_matches_float64_formula(calls):
    x = torch.randn(7, 2 * 48) * 3
    gate, up = x.double().chunk(2, dim=-1)
    got = silu_and_mul_cpu(x)
    torch.testing.assert_close(
        got.double(), gate / (1 + torch.exp(-gate)) * up, rtol=1e-6, atol=1e-6
    )
    assert calls == ["silu_and_mul"]


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_equals_the_twin(calls, cpu_dtype):
    # Widths a multiple of the vector width: ATen's silu and the op use the same vector exp.
    x = (torch.randn(5, 2 * 1536) * 3).to(cpu_dtype)
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_torch(x))
    assert calls == ["silu_and_mul"]


def test_silu_and_mul_equals_the_twin_across_the_float32_range(calls):
    # The op's own exp against ATen's: gates spread over every exponent and sign (a stride through
    # the 2^32 bit patterns, plus the cut-offs where exp(-g) underflows to 0 or overflows to inf,
    # infinities and NaN), up = 1 so each output is silu(g) itself.
    bits = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    gate = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    edges = torch.tensor([-104.0, -100.0, 100.0, 104.0, 88.7, -88.7, 0.0, -0.0])
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    gate = torch.cat((edges, edges.nextafter(torch.tensor(0.0)), special, gate))
    gate = gate[: gate.numel() // 64 * 64].view(-1, 64)
    got = silu_and_mul_cpu(torch.cat((gate, torch.ones_like(gate)), dim=1))
    want = torch.nn.functional.silu(gate)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert same.all(), (
        f"{int((~same).sum())} of {same.numel()} differ, e.g. at {gate[~same][:5].tolist()}"
    )
    assert calls == ["silu_and_mul"]


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul_tail_and_strided_rows(calls, assert_close, cpu_dtype):
    # 100 is no multiple of the vector width (a partial last vector); a row-strided column slice.
    wide = (torch.randn(6, 2 * 100 + 16) * 3).to(cpu_dtype)
    x = wide[:, : 2 * 100]
    assert_close(silu_and_mul_cpu(x), silu_and_mul_torch(x), cpu_dtype)
    assert calls == ["silu_and_mul"]


# --- Fallback ------------------------------------------------------------------------------------


def test_unloaded_library_falls_back_to_the_twins(calls, monkeypatch):
    monkeypatch.setattr(cpu_extension, "load", lambda: False)
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    assert torch.equal(rms_norm_cpu(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    for got, want in zip(
        rms_norm_cpu(x, weight, EPS, residual),
        rms_norm_torch(x, weight, EPS, residual),
        strict=True,
    ):
        assert torch.equal(got, want)
    q, k = _fused_qkv(3, 4, 2, 32, torch.float32)
    cache = rope_cos_sin_cache(32, 16, 10000.0, None, torch.float32, "cpu")
    positions = torch.tensor([0, 5, 2])
    for got, want in zip(
        apply_rotary_cpu(positions, q, k, cache),
        apply_rotary_torch(positions, q, k, cache),
        strict=True,
    ):
        assert torch.equal(got, want)
    gate_up = torch.randn(2, 2 * 20)
    assert torch.equal(silu_and_mul_cpu(gate_up), silu_and_mul_torch(gate_up))
    assert calls == []
