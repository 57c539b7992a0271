"""Writing new tokens' keys and values into the paged KV cache.

Cache layout of one layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
a token's slot is block_id * block_size + offset_in_block; slot -1 means "do not store".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cpu_extension


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping [T] (in place; -1 skipped)."""
    if bool((slot_mapping < 0).any()):  # rare: boolean masking costs 3 more ops per call
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    # view (not reshape): a copy would silently drop the writes.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`write_kv_cache_torch`'s contract, the "torch" backend's entry: the C++ op (one call, -1
    skipped without a host check, kernels/csrc/kv_cache_cpu.cpp) when it takes the tensors (same
    dtype throughout, contiguous caches, unit-stride head_dim), else the twin."""
    native = (
        cpu_extension.takes(k_cache)
        and key.dtype == value.dtype == v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )
    if not native:
        return write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)
    torch.ops.llm_cpu.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.long().contiguous())


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
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of `write_kv_cache_torch` (same contract). key/value may be strided views
    (e.g. slices of a fused qkv projection) as long as head_dim is unit-stride."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        head_dim,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
