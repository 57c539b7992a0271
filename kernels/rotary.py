"""Rotary position embedding (neox style, as HF Llama): cos/sin cache and its application to q and k.

The cache row of position p is [cos(p * inv_freq) | sin(p * inv_freq)], width rotary_dim. Only the
first rotary_dim dims of each head rotate (rotate_half over them); the rest pass through.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import cpu_extension


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between (same arithmetic as HF transformers, so results match bit for bit)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(
    base: float, exponents: torch.Tensor, rotary_dim: int, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("longrope", formerly "su"): per-frequency divisors (`long_factor` when the
    table spans more than `original_max_position_embeddings` positions, else `short_factor`) and
    the attention factor that scales cos and sin (`attention_factor`, else
    sqrt(1 + ln(factor) / ln(original)) for factor > 1), as transformers computes them.

    Which factors: transformers switches per forward by the sequence's length, which would leave
    keys cached under one set beside keys under the other; like vLLM, the table's size (the
    engine's max_model_len) decides once for every position."""
    original = scaling["original_max_position_embeddings"]
    divisors = scaling["long_factor"] if max_position > original else scaling["short_factor"]
    if len(divisors) != rotary_dim // 2:
        raise ValueError(
            f"longrope factors have {len(divisors)} entries, expected {rotary_dim // 2}"
        )
    ext = torch.tensor(divisors, dtype=torch.float32, device=exponents.device)
    inv_freq = 1.0 / (ext * base ** (exponents / rotary_dim))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor", 1.0)
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return inv_freq, float(attention_factor)


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """[max_position, rotary_dim] cache: cos in the first half of each row, sin in the second.

    rope_scaling: None / {"rope_type": "default"}, HF's llama3 dict, "linear" ({"factor"}: every
    frequency divided by it) or "longrope" (`_longrope_inv_freq`; "factor" there is
    max_position_embeddings / original_max_position_embeddings); "type" accepted for "rope_type".
    Computed in float32 like HF; use dtype=float32 to keep full precision.
    """
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(
        device=device, dtype=torch.float
    )
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    attention_factor = 1.0
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type in ("longrope", "su"):
        inv_freq, attention_factor = _longrope_inv_freq(
            base, exponents, rotary_dim, rope_scaling, max_position
        )
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope_type {rope_type!r} "
            "(expected 'default', 'llama3', 'linear' or 'longrope')"
        )
    positions = torch.arange(max_position, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(dtype)


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x [T, H, D] by cos/sin [T, 1, rotary_dim/2]."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return rotated.to(x.dtype)


def apply_rotary_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at positions [T]; returns NEW tensors (inputs untouched).
    Math in float32, results in q's / k's dtype."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate_torch(q, cos, sin), _rotate_torch(k, cos, sin)


def apply_rotary_cpu(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_torch`'s contract, the "torch" backend's entry: the C++ op (q and k of a token
    in one pass, kernels/csrc/elementwise_cpu.cpp) on tensors it takes, else the twin (same bits)."""
    native = (
        cpu_extension.takes(q)
        and k.dtype == q.dtype
        and cos_sin_cache.dtype == torch.float32
        and q.stride(-1) == 1
        and k.stride(-1) == 1
    )
    if not native:
        return apply_rotary_torch(positions, q, k, cos_sin_cache)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    torch.ops.llm_cpu.rotary(
        positions.long().contiguous(), q, k, cos_sin_cache.contiguous(), q_out, k_out
    )
    return q_out, k_out


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cache_ptr,
    stride_x_t,
    stride_x_h,
    stride_out_t,
    stride_out_h,
    stride_cache,
    num_heads,
    ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program rotates all heads of one token: x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < ROT_HALF
    cos = tl.load(cache_ptr + pos * stride_cache + half, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + ROT_HALF + half, mask=half_mask, other=0.0)
    sin = sin.to(tl.float32)

    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & half_mask[None, :]
    x_row = x_ptr + token * stride_x_t + heads * stride_x_h + half[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + ROT_HALF, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + token * stride_out_t + heads * stride_out_h + half[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_row, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(out_row + ROT_HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)


def _rotate_triton(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor
) -> torch.Tensor:
    """Rotated copy of x [T, H, D]; dims past rotary_dim are copied through unchanged."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rot_half = cos_sin_cache.shape[-1] // 2
    num_tokens, num_heads, head_dim = x.shape
    # Partial rotary: the pass-through dims come from the copy, the kernel overwrites the rest.
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if 2 * rot_half < head_dim:
        out.copy_(x)
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            x,
            out,
            positions,
            cos_sin_cache,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos_sin_cache.stride(0),
            num_heads,
            ROT_HALF=rot_half,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(rot_half),
        )
    return out


def apply_rotary_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `apply_rotary_torch` (same contract: returns new tensors)."""
    return _rotate_triton(positions, q, cos_sin_cache), _rotate_triton(positions, k, cos_sin_cache)
