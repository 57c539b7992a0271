"""Paged attention: the torch reference against a naive per-token float64 implementation, the Triton
kernel (unified and split-KV paths) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_torch, paged_attention_triton
from tests.kernels.attention_helpers import CASES, Case, Inputs, make_inputs, naive_attention


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_torch_reference_matches_naive(case, ref_dtype, device, assert_close):
    inputs = make_inputs(case, ref_dtype, device)
    out = torch.full_like(inputs.q, float("nan"))
    got = paged_attention_torch(*inputs.args(), out=out)
    assert got is out
    assert_close(got, naive_attention(inputs).to(ref_dtype), ref_dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["unified", "split-kv"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_torch(case, num_kv_splits, dtype, device, run_poisoned, assert_close):
    inputs = make_inputs(case, dtype, device)
    want = paged_attention_torch(*inputs.args())
    out = torch.full_like(inputs.q, float("nan"))
    got = run_poisoned(paged_attention_triton, *inputs.args(), out=out, num_kv_splits=num_kv_splits)
    assert got is out
    assert_close(got, want, dtype)


def test_triton_default_split_choice_matches_torch(device, run_poisoned, assert_close):
    # No num_kv_splits: the kernel picks (1 off CUDA; on CUDA a long table with few tiles splits).
    inputs = make_inputs(Case((1, 1), (600, 70), 8, 2, 64, 16), torch.float32, device)
    got = run_poisoned(paged_attention_triton, *inputs.args())
    assert_close(got, paged_attention_torch(*inputs.args()), torch.float32)


def test_triton_reads_strided_queries(device, run_poisoned, assert_close):
    # q as a view into a fused qkv output (row stride larger than Hq * D).
    case = CASES["mixed-prefill-decode-d96"]
    inputs = make_inputs(case, torch.float32, device)
    fused = torch.randn(inputs.q.shape[0], 2 * case.num_heads, case.head_dim, device=device)
    fused[:, : case.num_heads] = inputs.q
    inputs.q = fused[:, : case.num_heads]
    got = run_poisoned(paged_attention_triton, *inputs.args())
    assert_close(got, paged_attention_torch(*inputs.args()), torch.float32)


def test_decode_length_groups_cover_every_sequence_once_with_little_padding():
    from kernels.paged_attention import _length_groups

    lengths = [torch.randint(1, 2000, ()).item() for _ in range(200)]
    groups = _length_groups(lengths, max_waste=0.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = lengths[group[0]]
        assert all(lengths[i] <= longest for i in group)
        assert all(lengths[i] >= 0.75 * longest for i in group)  # padding <= 25% per member


def test_torch_plan_built_once_serves_every_layer_and_window(device, assert_close):
    # The engine builds one plan per step and passes it to every layer (of any sliding window);
    # a layer's own caches differ, so the plan may hold only metadata-derived tensors.
    from kernels.paged_attention import plan_paged_attention_torch

    case = CASES["sliding-window"]
    inputs = make_inputs(case, torch.float32, device)
    plan = plan_paged_attention_torch(
        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache
    )
    for window in (case.sliding_window, None, case.sliding_window):
        inputs.sliding_window = window
        for k_cache, v_cache in (
            (inputs.k_cache, inputs.v_cache),
            (inputs.v_cache.clone(), inputs.k_cache.clone()),
        ):
            layer = Inputs(**{**vars(inputs), "k_cache": k_cache, "v_cache": v_cache})
            got = paged_attention_torch(*layer.args(), plan=plan)
            assert_close(got, naive_attention(layer).float(), torch.float32)


def test_torch_consecutive_decodes_from_strided_queries(device, assert_close):
    # Decodes sorted longest first (as the engine orders a batch) become one slice of rows; q as
    # a view into a fused qkv output must still be read correctly.
    case = Case((1, 1, 1, 1, 6), (40, 38, 36, 9, 6), 8, 2, 64, 8)
    inputs = make_inputs(case, torch.float32, device)
    fused = torch.randn(inputs.q.shape[0], 2 * case.num_heads, case.head_dim, device=device)
    fused[:, : case.num_heads] = inputs.q
    inputs.q = fused[:, : case.num_heads]
    assert_close(
        paged_attention_torch(*inputs.args()), naive_attention(inputs).float(), torch.float32
    )
