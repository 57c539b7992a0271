"""Paged attention: the torch reference against a naive per-token float64 implementation, the Triton
kernel (unified and split-KV paths) against the torch reference; bidirectional spans (visible_until)
through every path against a dense masked float64 reference."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_torch,
    paged_attention_triton,
    plan_paged_attention_torch,
)
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


# Bidirectional spans (visible_until): a mixed batch of decodes, short chunks after a cached prefix
# and a fresh prompt, GQA 2. Spans (first, last position) per sequence: in seq 1 one starts inside
# the cached prefix (positions < 25) and ends among the new tokens; in seq 3 one crosses Triton's
# 32-token query tiles; seq 4 has none and stays with the C++ op.
SPAN_QUERY_LENS, SPAN_CONTEXT_LENS = (1, 12, 1, 40, 6), (23, 37, 9, 40, 14)
SPANS = {1: [(21, 30), (33, 35)], 3: [(5, 17), (30, 35)]}
LIMITED_PATHS = ["torch", "cpu", "triton-unified", "triton-split-kv"]


def _span_inputs(window: int | None, device: torch.device) -> Inputs:
    case = Case(SPAN_QUERY_LENS, SPAN_CONTEXT_LENS, 4, 2, 32, 8, sliding_window=window)
    return make_inputs(case, torch.float32, device)


def _limits(inputs: Inputs, spans: dict[int, list[tuple[int, int]]]) -> torch.Tensor:
    """visible_until [T] int32: the last position of a token's span, else its own position."""
    starts, limits = inputs.query_start_loc.tolist(), []
    for b, context_len in enumerate(inputs.seq_lens.tolist()):
        for pos in range(context_len - (starts[b + 1] - starts[b]), context_len):
            limits.append(
                max([last for first, last in spans.get(b, []) if first <= pos <= last] or [pos])
            )
    return torch.tensor(limits, dtype=torch.int32, device=inputs.q.device)


def _dense_reference(inputs: Inputs, limits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """float64, per sequence: one plain softmax of its new tokens' scores over its whole context,
    masked by the contract (key k visible to the token at p iff k <= limit and, with a window,
    k > p - window)."""
    q, block_size = inputs.q, inputs.k_cache.shape[1]
    groups = q.shape[1] // inputs.k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    starts = inputs.query_start_loc.tolist()
    for b, context_len in enumerate(inputs.seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        key_pos = torch.arange(context_len, device=q.device)
        slots = (inputs.block_tables[b][key_pos // block_size].long(), key_pos % block_size)
        keys = inputs.k_cache[slots].double().repeat_interleave(groups, dim=1)  # [S, Hq, D]
        values = inputs.v_cache[slots].double().repeat_interleave(groups, dim=1)
        query_pos = key_pos[context_len - (rows.stop - rows.start) :, None]
        mask = key_pos[None, :] <= limits[rows, None]
        if inputs.sliding_window is not None:
            mask &= key_pos[None, :] > query_pos - inputs.sliding_window
        scores = torch.einsum("lhd,shd->hls", q[rows].double(), keys) * inputs.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hls,shd->lhd", weights, values)
    return out


def _run_limited(path: str, inputs: Inputs, request, run_poisoned, **kwargs) -> torch.Tensor:
    """paged_attention through `path` (LIMITED_PATHS) into a NaN-filled output."""
    out = torch.full_like(inputs.q, float("nan"))
    if path == "torch":
        return paged_attention_torch(*inputs.args(), out=out, **kwargs)
    if path == "cpu":
        if inputs.q.is_cpu:
            request.getfixturevalue("cpu_kernels")  # the C++ op loaded (skips without a compiler)
        return paged_attention_cpu(*inputs.args(), out=out, **kwargs)
    splits = 1 if path == "triton-unified" else 3
    return run_poisoned(
        paged_attention_triton, *inputs.args(), out=out, num_kv_splits=splits, **kwargs
    )


@pytest.mark.parametrize(
    ("window", "softcap"), [(None, None), (6, 2.0)], ids=["full", "window-6-softcap"]
)
@pytest.mark.parametrize("path", LIMITED_PATHS)
def test_visible_until_matches_dense_reference(
    path, window, softcap, device, request, run_poisoned, assert_close
):
    inputs = _span_inputs(window, device)
    limits = _limits(inputs, SPANS)
    got = _run_limited(path, inputs, request, run_poisoned, softcap=softcap, visible_until=limits)
    assert_close(got, _dense_reference(inputs, limits, softcap).float(), torch.float32)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window-6"])
@pytest.mark.parametrize("path", LIMITED_PATHS[:3])
def test_visible_until_at_own_positions_is_causal(
    path, window, device, request, run_poisoned, assert_close
):
    inputs = _span_inputs(window, device)
    causal = _run_limited(path, inputs, request, run_poisoned)
    got = _run_limited(path, inputs, request, run_poisoned, visible_until=_limits(inputs, {}))
    if path in ("torch", "cpu") and device.type == "cpu":  # same plan, same CPU kernels: bitwise
        assert torch.equal(got, causal)
    else:
        assert_close(got, causal, torch.float32)
    assert_close(got, naive_attention(inputs).float(), torch.float32)


def test_planner_leaves_span_sequences_to_sdpa(device):
    inputs = _span_inputs(None, device)
    meta = (inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache)
    limits = _limits(inputs, SPANS)
    plan = plan_paged_attention_torch(*meta, native=True, visible_until=limits)
    assert plan.native_seqs.tolist() == [0, 2, 4]
    assert [(p.start, p.end) for p in plan.prefills] == [(1, 13), (14, 54)]
    assert plan.decode_groups == []
    # Limits at every token's own position: routed as without them.
    own = plan_paged_attention_torch(*meta, native=True, visible_until=_limits(inputs, {}))
    assert own.native_seqs.tolist() == [0, 1, 2, 3, 4] and own.prefills == []
    # A single new token sees nothing after itself; a plan without limits cannot serve them.
    with pytest.raises(ValueError, match="single new token"):
        plan_paged_attention_torch(*meta, visible_until=_limits(inputs, {}) + 1)
    causal_plan = plan_paged_attention_torch(*meta, native=True)
    with pytest.raises(ValueError, match="plan built with it"):
        paged_attention_cpu(*inputs.args(), plan=causal_plan, visible_until=limits)
