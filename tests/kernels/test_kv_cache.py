"""KV-cache write: the torch reference against a per-token loop, the Triton kernel and the C++ CPU op
against the reference (exact: it is a copy)."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import write_kv_cache_cpu, write_kv_cache_torch, write_kv_cache_triton

NUM_BLOCKS, BLOCK_SIZE = 6, 8


def _caches(num_kv_heads, head_dim, dtype, device):
    # Random (not zero) old contents, so a missed or misplaced write changes the comparison.
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _slots(num_tokens: int, device) -> torch.Tensor:
    """Distinct random slots (first/last slot of the pool included), every third token skipped."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE - 2)[: num_tokens - 2] + 1
    slots = torch.cat([torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE - 1]), slots])[
        torch.randperm(num_tokens)
    ]
    slots[::3] = -1
    return slots.to(device)


def test_torch_reference_matches_loop(device):
    num_tokens, num_kv_heads, head_dim = 10, 2, 64
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, device=device)
    k_cache, v_cache = _caches(num_kv_heads, head_dim, torch.float32, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = _slots(num_tokens, device)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[t]
            want_v[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[t]
    write_kv_cache_torch(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 1, 64), (9, 2, 128), (12, 3, 80)])
def test_triton_matches_torch(device, dtype, num_tokens, num_kv_heads, head_dim):
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    slots = _slots(num_tokens, device) if num_tokens > 1 else torch.tensor([17], device=device)
    k_cache, v_cache = _caches(num_kv_heads, head_dim, dtype, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_torch(key, value, want_k, want_v, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_triton_all_skipped_writes_nothing(device):
    key = value = torch.randn(4, 2, 64, device=device)
    k_cache, v_cache = _caches(2, 64, torch.float32, device)
    before = k_cache.clone(), v_cache.clone()
    write_kv_cache_triton(key, value, k_cache, v_cache, torch.full((4,), -1, device=device))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_triton_reads_strided_kv_views(device):
    # key/value as views into one fused qkv output (row stride larger than Hkv * D).
    num_tokens, num_kv_heads, head_dim = 7, 2, 64
    qkv = torch.randn(num_tokens, 8 * head_dim, device=device)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = _slots(num_tokens, device)
    k_cache, v_cache = _caches(num_kv_heads, head_dim, torch.float32, device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_torch(key, value, want_k, want_v, slots)
    write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# The C++ op (kernels/csrc/kv_cache_cpu.cpp) through the "torch" backend's entry, write_kv_cache_cpu.


@pytest.fixture
def cpu_writes(cpu_kernels, monkeypatch) -> list[int]:
    """Token counts of the llm_cpu.write_kv_cache calls of the test (a silent fallback fails)."""
    calls: list[int] = []
    real = cpu_kernels.write_kv_cache

    def spy(key, *args):
        calls.append(key.shape[0])
        return real(key, *args)

    monkeypatch.setattr(cpu_kernels, "write_kv_cache", spy)
    return calls


@pytest.mark.parametrize("cpu_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_op_equals_the_twin_on_strided_views(cpu_writes, cpu_dtype):
    # key/value as views into one fused qkv output, every third slot -1, first and last slot used.
    num_tokens, num_kv_heads, head_dim = 12, 2, 64
    qkv = torch.randn(num_tokens, 8 * head_dim).to(cpu_dtype)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = _slots(num_tokens, "cpu")
    k_cache, v_cache = _caches(num_kv_heads, head_dim, cpu_dtype, "cpu")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_torch(key, value, want_k, want_v, slots)
    write_kv_cache_cpu(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert cpu_writes == [num_tokens]


def test_cpu_op_refuses_slots_outside_the_cache(cpu_writes):
    key = value = torch.randn(3, 2, 64)
    k_cache, v_cache = _caches(2, 64, torch.float32, "cpu")
    before = k_cache.clone()
    bad = torch.tensor([0, NUM_BLOCKS * BLOCK_SIZE, 5])
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 48 outside the cache's 48 slots"):
        write_kv_cache_cpu(key, value, k_cache, v_cache, bad)
    assert torch.equal(k_cache, before)  # checked before any write


def test_cpu_entry_falls_back_on_a_dtype_change(cpu_writes):
    # float32 keys into a bfloat16 cache: the twin converts, the op does not take it.
    key = value = torch.randn(4, 2, 64)
    k_cache, v_cache = _caches(2, 64, torch.bfloat16, "cpu")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 40, 7])
    write_kv_cache_torch(key, value, want_k, want_v, slots)
    write_kv_cache_cpu(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert cpu_writes == []
