"""Fused mixture-of-experts: routing, the block alignment, the Triton grouped GEMM and the PyTorch
twin against a naive loop over tokens and slots (float64), including routing ties, an expert with
no tokens and one expert taking every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import kernel_ops
from kernels.fused_moe import (
    fused_moe_torch,
    fused_moe_triton,
    grouped_moe,
    moe_align_block_size,
    moe_route,
)


def _naive_moe(x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """One token and one slot at a time, float64."""
    x, w_gate_up, w_down = x.double(), w_gate_up.double(), w_down.double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    inter = w_down.shape[2]
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gate_up = w_gate_up[e] @ x[n]
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[n] += float(weights[n, j]) * (w_down[e] @ hidden)
    return out


def _weights(experts, hidden, inter, dtype, device):
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    return w_gate_up, w_down


def _routing(case: str, tokens: int, experts: int, top_k: int, device):
    logits = torch.randn(tokens, experts, device=device)
    if case == "unused-expert":
        logits[:, 2] = -30.0  # expert 2 never in any top-k
    elif case == "one-expert-all":
        logits[:, 1] = 30.0  # every token picks expert 1 (first slot)
    elif case == "ties":
        logits[:, :] = 0.0  # all equal: torch.topk's tie order decides
        logits[::2, 3] = 1.0
    return moe_route(logits, top_k, renormalize=True)


CASES = ["random", "unused-expert", "one-expert-all", "ties"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", [1, 19])
def test_twin_and_triton_match_naive_loop(device, dtype, case, tokens, run_poisoned, assert_close):
    experts, hidden, inter, top_k = 6, 48, 40, 2  # 40: masked tails in the GEMM's blocks
    w_gate_up, w_down = _weights(experts, hidden, inter, dtype, device)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights, ids = _routing(case, tokens, experts, top_k, device)
    if case == "unused-expert":
        assert not (ids == 2).any()
    if case == "one-expert-all":
        assert (ids[:, 0] == 1).all()
    want = _naive_moe(x, w_gate_up, w_down, weights, ids).to(dtype)
    assert_close(fused_moe_torch(x, w_gate_up, w_down, weights, ids), want, dtype)
    got = run_poisoned(fused_moe_triton, x, w_gate_up, w_down, weights, ids)
    assert_close(got, want, dtype)


def test_top1_of_many_experts_and_top_k_equal_to_experts(device, run_poisoned, assert_close):
    hidden, inter = 32, 16
    for experts, top_k in ((9, 1), (3, 3)):
        w_gate_up, w_down = _weights(experts, hidden, inter, torch.float32, device)
        x = torch.randn(11, hidden, device=device)
        weights, ids = moe_route(torch.randn(11, experts, device=device), top_k, False)
        want = _naive_moe(x, w_gate_up, w_down, weights, ids).float()
        got = run_poisoned(fused_moe_triton, x, w_gate_up, w_down, weights, ids)
        assert_close(got, want, torch.float32)
        assert_close(fused_moe_torch(x, w_gate_up, w_down, weights, ids), want, torch.float32)


def test_routing_is_softmax_then_topk_optionally_renormalised():
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = moe_route(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    ref_w, ref_ids = torch.topk(probs, 2, dim=-1)  # ties broken exactly as transformers' routers
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    normed, normed_ids = moe_route(logits, 2, renormalize=True)
    assert torch.equal(normed_ids, ref_ids)
    torch.testing.assert_close(normed, ref_w / ref_w.sum(-1, keepdim=True))
    torch.testing.assert_close(normed[1], torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size_segments(block_m):
    experts, top_k = 5, 2
    ids = torch.tensor([[0, 3], [3, 1], [3, 0], [4, 3], [3, 1], [0, 4], [3, 4]])
    blocks = moe_align_block_size(ids, experts, block_m)
    pairs = ids.numel()
    sorted_ids, block_expert = blocks.sorted_ids.long(), blocks.block_expert.long()
    assert sorted_ids.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        real = rows[rows < pairs]
        if expert < 0:
            assert real.numel() == 0  # past the last segment: padding only
            continue
        assert (flat[real] == expert).all()  # one expert per block
        assert torch.equal(real, real.sort().values)  # flat order within the expert
        seen += real.tolist()
    assert sorted(seen) == list(range(pairs))  # every pair exactly once
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and 2 not in used  # ascending; the empty expert has no block
    counts = torch.bincount(flat, minlength=experts)
    assert len(used) == int(((counts + block_m - 1) // block_m).sum())
    assert top_k == 2


def test_grouped_runs_each_expert_once_over_all_its_tokens():
    experts, hidden, inter = 4, 16, 8
    w_gate_up, w_down = _weights(experts, hidden, inter, torch.float32, "cpu")
    x = torch.randn(10, hidden)
    weights, ids = moe_route(torch.randn(10, experts), 2, True)
    ids[:, 1] = torch.where(ids[:, 0] == 3, 0, 3)  # expert 3 takes every token once...
    calls: list[tuple[int, int]] = []

    def expert(e):
        def gate_up(h):
            calls.append((e, h.shape[0]))
            return F.linear(h, w_gate_up[e])

        return gate_up, lambda h: F.linear(h, w_down[e])

    ops = kernel_ops("torch")
    got = grouped_moe(x, weights, ids, [expert(e) for e in range(experts)], ops.silu_and_mul)
    torch.testing.assert_close(got, _naive_moe(x, w_gate_up, w_down, weights, ids).float())
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    assert calls == [(e, c) for e, c in enumerate(counts) if c]  # ...in one call
    assert (3, 10) in calls


def test_kernel_ops_carry_both_backends():
    assert kernel_ops("torch").fused_moe is fused_moe_torch
    assert kernel_ops("triton").fused_moe is fused_moe_triton
