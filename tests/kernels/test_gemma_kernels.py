"""Gemma's kernel features under their one contract: GELU(tanh)-and-mul (PyTorch twin against
transformers' "gelu_pytorch_tanh", the C++ op and the Triton kernel against the twin) and attention
logit soft-capping in paged attention (twin against the naive float64 reference, C++ op and Triton
kernel against the twin)."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from kernels.activation import (
    gelu_tanh_and_mul_cpu,
    gelu_tanh_and_mul_torch,
    gelu_tanh_and_mul_triton,
)
from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_torch,
    paged_attention_triton,
    plan_paged_attention_cpu,
)
from tests.kernels.attention_helpers import CASES, Case, make_inputs, naive_attention

SOFTCAP = 2.0
"""Small enough that capping changes the scores of these inputs (|s| up to ~4) a lot."""
SOFTCAP_CASES = {
    "mixed-prefill-decode": CASES["mixed-prefill-decode-d96"],
    "prefix-cached-window": Case((5, 1, 9), (37, 20, 25), 4, 2, 64, 8, sliding_window=8),
    # Gemma's head_dim 256: the Triton wrapper's narrower prefill tiles (tile_config).
    "d256-prefill-window": Case((9, 1), (20, 30), 4, 2, 256, 8, sliding_window=8),
}


def test_gelu_twin_matches_transformers():
    x = torch.randn(7, 2 * 40) * 3
    gate, up = x.chunk(2, dim=-1)
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(gelu_tanh_and_mul_torch(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cpu_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter_size", [64, 100])
def test_gelu_cpp_op_matches_twin(cpu_kernels, monkeypatch, cpu_dtype, inter_size, assert_close):
    calls = []
    real = cpu_kernels.gelu_tanh_and_mul
    monkeypatch.setattr(cpu_kernels, "gelu_tanh_and_mul", lambda *a: calls.append(1) or real(*a))
    wide = (torch.randn(5, 2 * inter_size + 8) * 3).to(cpu_dtype)
    x = wide[:, : 2 * inter_size]  # row-strided, as a fused projection hands it over
    assert_close(gelu_tanh_and_mul_cpu(x), gelu_tanh_and_mul_torch(x), cpu_dtype)
    assert calls == [1]


@pytest.mark.parametrize("num_tokens,inter_size", [(1, 64), (3, 1500)])
def test_gelu_triton_matches_twin(
    device, dtype, num_tokens, inter_size, run_poisoned, assert_close
):
    x = (torch.randn(num_tokens, 2 * inter_size, device=device) * 3).to(dtype)
    got = run_poisoned(gelu_tanh_and_mul_triton, x)
    assert_close(got, gelu_tanh_and_mul_torch(x), dtype)


@pytest.mark.parametrize("case", SOFTCAP_CASES.values(), ids=SOFTCAP_CASES.keys())
def test_softcap_twin_matches_naive(case, device, assert_close):
    inputs = make_inputs(case, torch.float32, device)
    inputs.q *= 3  # scores well past the cap
    got = paged_attention_torch(*inputs.args(), softcap=SOFTCAP)
    assert_close(got, naive_attention(inputs, SOFTCAP).float(), torch.float32)
    uncapped = naive_attention(inputs).float()
    assert (got - uncapped).abs().max() > 0.1  # the cap matters on these inputs


@pytest.mark.parametrize("case", SOFTCAP_CASES.values(), ids=SOFTCAP_CASES.keys())
def test_softcap_cpp_op_matches_twin(case, cpu_kernels, monkeypatch, assert_close):
    inputs = make_inputs(case, torch.float32, torch.device("cpu"))
    inputs.q *= 3
    calls = []
    real = cpu_kernels.paged_attention
    monkeypatch.setattr(
        cpu_kernels, "paged_attention", lambda *a, **k: calls.append(k) or real(*a, **k)
    )
    plan = plan_paged_attention_cpu(
        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache
    )
    got = paged_attention_cpu(*inputs.args(), plan=plan, softcap=SOFTCAP)
    assert calls == [{"softcap": SOFTCAP}]
    assert_close(got, paged_attention_torch(*inputs.args(), softcap=SOFTCAP), torch.float32)


@pytest.mark.parametrize(
    "name,num_kv_splits",
    [("prefix-cached-window", 1), ("prefix-cached-window", 3), ("d256-prefill-window", 1)],
)
def test_softcap_triton_matches_twin(
    name, num_kv_splits, dtype, device, run_poisoned, assert_close
):
    inputs = make_inputs(SOFTCAP_CASES[name], dtype, device)
    inputs.q *= 3
    want = paged_attention_torch(*inputs.args(), softcap=SOFTCAP)
    got = run_poisoned(
        paged_attention_triton, *inputs.args(), num_kv_splits=num_kv_splits, softcap=SOFTCAP
    )
    assert_close(got, want, dtype)
