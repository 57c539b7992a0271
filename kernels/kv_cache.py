"""Writing new tokens' keys and values into the paged KV cache.

Cache layout of one layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
a token's slot is block_id * block_size + offset_in_block; slot -1 means "do not store".

8-bit caches (`QUANTIZED_KV_DTYPES`: int8, float8_e4m3fn) also take k_scale, v_scale
[num_blocks, block_size, num_kv_heads] float32: each stored (token, kv head) row x [D] is kept as
round(x / scale) (int8; fp8: the cast), scale = max|x| / QMAX over its head_dim (symmetric, QMAX 127
for int8, 448 for fp8), written with it; it reads back as q * scale (`dequantize_kv`). Other caches
take no scales (None) and store key/value cast to their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cpu_extension

QUANTIZED_KV_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""8-bit cache dtypes and their QMAX (the largest magnitude stored; module docstring)."""
_TINY = torch.finfo(torch.float32).tiny  # divisor floor: an all-zero row divides 0 by it


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., D] in `dtype`, scale [...] float32) of rows x [..., D], symmetric per row over D:
    scale = max|x| / QMAX, q = round(x / scale) (int8) or its fp8 cast, clamped to +-QMAX."""
    qmax = QUANTIZED_KV_DTYPES[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1) / qmax
    scaled = (x / scale.clamp_min(_TINY)[..., None]).clamp_(-qmax, qmax)
    return (scaled.round_() if dtype == torch.int8 else scaled).to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] (an 8-bit cache's rows) times scale [...] -> [..., D] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or for float8 its bytes (uint8, same shape): index_copy_ has no float8 kernel."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether the write quantizes (an 8-bit cache, which must come with its scales)."""
    quantized = k_cache.dtype in QUANTIZED_KV_DTYPES
    if quantized != (k_scale is not None):
        raise ValueError(
            f"a {k_cache.dtype} cache takes {'k_scale/v_scale' if quantized else 'no scales'}"
        )
    return quantized


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping [T] (in place; -1 skipped);
    an 8-bit cache quantizes them and writes their scales into k_scale/v_scale (module docstring)."""
    quantized = _check_scales(k_cache, k_scale)
    if bool((slot_mapping < 0).any()):  # rare: boolean masking costs 3 more ops per call
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if quantized:
        key, k_scales = quantize_kv(key, k_cache.dtype)
        value, v_scales = quantize_kv(value, v_cache.dtype)
        k_scale.view(-1, k_scale.shape[-1]).index_copy_(0, slot_mapping, k_scales)
        v_scale.view(-1, v_scale.shape[-1]).index_copy_(0, slot_mapping, v_scales)
        key, value, k_cache, v_cache = map(byte_view, (key, value, k_cache, v_cache))
    # view (not reshape): a copy would silently drop the writes.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`write_kv_cache_torch`'s contract, the "torch" backend's entry: the C++ op (one call, -1
    skipped without a host check, kernels/csrc/kv_cache_cpu.cpp) when it takes the tensors (same
    dtype throughout, or an 8-bit cache with contiguous scales; contiguous caches, unit-stride
    head_dim), else the twin."""
    quantized = _check_scales(k_cache, k_scale)
    native = (
        cpu_extension.takes(key)
        and k_cache.is_cpu
        and key.dtype == value.dtype
        and v_cache.dtype == k_cache.dtype
        and (k_cache.dtype == key.dtype or quantized)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )
    if quantized:
        native = native and k_scale.is_contiguous() and v_scale.is_contiguous()
    if not native:
        return write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    scales = (k_scale, v_scale) if quantized else ()
    torch.ops.llm_cpu.write_kv_cache(
        key, value, k_cache, v_cache, slot_mapping.long().contiguous(), *scales
    )


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    head_dim,
    k_scale_ptr,
    v_scale_ptr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr = 0.0,
    FP8: tl.constexpr = False,
):
    # One program copies all heads of one token; the cache is contiguous, so slot s starts at s*Hkv*D.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Broadcast the slot before comparing: the interpreter rejects a scalar bool in a mask.
    stored = (slot + tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64)) >= 0
    mask = (heads < NUM_KV_HEADS) & (dims < head_dim) & stored
    cache_offset = slot * NUM_KV_HEADS * head_dim + heads * head_dim + dims
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    if QMAX > 0:  # an 8-bit cache: quantize each head's row, store its scale (module docstring)
        scale_offset = slot * NUM_KV_HEADS + tl.arange(0, BLOCK_H)
        stored_row = (slot + tl.zeros([BLOCK_H], dtype=tl.int64)) >= 0
        scale_mask = (tl.arange(0, BLOCK_H) < NUM_KV_HEADS) & stored_row
        # Masked-off lanes of a load are undefined on a GPU: zero them before the row maxima.
        key_q, key_scale = _quantize_rows(tl.where(mask, key, 0.0), QMAX, FP8)
        value_q, value_scale = _quantize_rows(tl.where(mask, value, 0.0), QMAX, FP8)
        tl.store(k_cache_ptr + cache_offset, key_q, mask=mask)
        tl.store(v_cache_ptr + cache_offset, value_q, mask=mask)
        tl.store(k_scale_ptr + scale_offset, key_scale, mask=scale_mask)
        tl.store(v_scale_ptr + scale_offset, value_scale, mask=scale_mask)
    else:
        tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, FP8: tl.constexpr):
    """`quantize_kv` of rows x [H, D] (padding elements 0): (int8 rows, or fp8 rows as their
    bytes, uint8; scales [H] float32). IEEE division and round half to even, as the twin."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    scaled = tl.math.div_rn(x, tl.maximum(scale, 1.1754943508222875e-38)[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    q = _float8_e4m3fn_bits(scaled) if FP8 else _round_half_even(scaled).to(tl.int8)
    return q, scale


@triton.jit
def _round_half_even(x):
    """x (float32, |x| < 2^22) rounded to an integer, ties to even: adding 1.5 * 2^23 leaves no
    fraction bits, and float32 addition rounds to nearest even."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _float8_e4m3fn_bits(x):
    """The float8_e4m3fn bits (uint8) of x (float32, |x| <= 448), rounded to nearest even as
    torch's cast. Bit arithmetic rather than a cast: Triton's interpreter casts some values to the
    wrong binade (reading fp8 back is right there)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 31).to(tl.uint8) << 7
    magnitude = bits & 0x7FFFFFFF
    # Normal range (|x| >= 2^-6): drop 20 of the 23 mantissa bits rounding half to even (a carry
    # moves into the exponent), then rebias the exponent from 127 to 7.
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormals: multiples of 2^-9 (8 of them is 2^-6, the smallest normal's code).
    subnormal = _round_half_even(tl.abs(x) * 512.0).to(tl.uint32)
    code = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000: 2^-6
    return code.to(tl.uint8) | sign


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of `write_kv_cache_torch` (same contract). key/value may be strided views
    (e.g. slices of a fused qkv projection) as long as head_dim is unit-stride."""
    quantized = _check_scales(k_cache, k_scale)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if quantized and not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # The 8-bit variant only where asked: the plain launch stays what it was.
    quantization = {"QMAX": QUANTIZED_KV_DTYPES[k_cache.dtype], "FP8": fp8} if quantized else {}
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        byte_view(k_cache),  # float8 as its bytes: the kernel stores the cast's bits
        byte_view(v_cache),
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        head_dim,
        k_scale if quantized else k_cache,  # placeholders when not quantizing
        v_scale if quantized else v_cache,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **quantization,
    )
