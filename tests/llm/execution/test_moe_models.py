"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache against Hugging
Face transformers (float32): each MoE block against transformers' block on the same weights, then
whole-model logits and greedy tokens (batched, chunked prefill, prefix sharing via block tables,
the Triton kernels under the interpreter), int8 experts, and checkpoint layouts."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.linear import PackedLinear
from backend_lib.llm.execution.attention import select_kernel_ops
from backend_lib.llm.execution.loader import load_model
from backend_lib.llm.execution.models.moe import SparseMoeBlock, StackedExperts
from backend_lib.llm.execution.models.step_kernels import OpsKernels
from backend_lib.quantization import QuantizedLinear
from tests.llm.config_helpers import BLOCK_SIZE
from tooling.checkpoints import MOE_ARCHITECTURES
from tooling.hf_reference import hf_greedy, hf_next_logits

ATOL = RTOL = 1e-4
CPU = torch.device("cpu")


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=gen).tolist()


def _assert_rows_match_hf(logits: torch.Tensor, seqs, hf) -> None:
    assert logits.shape[0] == len(seqs)
    for row, seq in zip(logits, seqs, strict=True):
        torch.testing.assert_close(row, hf_next_logits(hf, seq.token_ids), atol=ATOL, rtol=RTOL)


def _load(model_dir, backend="torch", pack=True, quantization="none"):
    return load_model(
        model_dir,
        CPU,
        torch.float32,
        select_kernel_ops(backend, "cpu"),
        pack_linear_weights=pack,
        quantization=quantization,
    )


class _NoPlan:
    plan = None


def _mlp_call(model, index, x):
    kernels = OpsKernels(model.ops, None, _NoPlan(), None, model.args.rms_norm_eps)
    return model.layer_calls[index].mlp(kernels, x, None)


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe(request, checkpoint):
    return checkpoint(request.param)


# --- the MoE block against transformers' --------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_blocks_match_transformers_blocks(moe, backend):
    """Every layer's MLP (sparse and dense) on the same input as transformers' module: the CPU
    grouped path over oneDNN-packed experts, and the stacked experts through the Triton kernel."""
    model_dir, hf = moe
    model = _load(model_dir, backend)
    x = torch.randn(13, model.args.hidden_size)
    kinds = []
    for index, hf_layer in enumerate(hf.model.layers):
        block = model.model.layers[index].mlp
        kinds.append(isinstance(block, SparseMoeBlock))
        if kinds[-1]:
            experts = block.experts
            if backend == "triton":
                assert isinstance(experts, StackedExperts)
            else:
                assert all(isinstance(e.gate_up_proj, PackedLinear) for e in experts)
        with torch.no_grad():
            want = hf_layer.mlp(x[None])[0]
        torch.testing.assert_close(_mlp_call(model, index, x), want, atol=1e-5, rtol=1e-5)
    assert kinds == list(model.args.sparse_layers) and any(kinds)


def _router(kind: str, experts: int, hidden: int) -> torch.Tensor:
    """A router for inputs of positive entries: `ties` scores every expert alike; `skewed` sends
    every token to experts 1 and 3, never to the others (the last one least of all)."""
    if kind == "ties":
        return torch.zeros(experts, hidden)
    weight = torch.full((experts, hidden), -1.0)
    weight[1], weight[3], weight[-1] = 2.0, 1.0, -3.0
    return weight


@pytest.mark.parametrize("kind", ["ties", "skewed"])
@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_routing_ties_and_skew_match_transformers(checkpoint, arch, kind):
    """Tied router scores (torch.topk's order decides, as in transformers), and one expert taking
    every token while most get none: the block's output is transformers'."""
    model_dir, hf = checkpoint(arch)
    x = torch.rand(6, hf.config.hidden_size) + 0.1
    for backend in ("torch", "triton"):
        model = _load(model_dir, backend)
        router = model.model.layers[0].mlp.gate.weight
        hf_router = hf.model.layers[0].mlp.gate.weight
        weight = _router(kind, router.shape[0], router.shape[1])
        saved = hf_router.detach().clone()
        try:
            with torch.no_grad():
                router.copy_(weight)
                hf_router.copy_(weight)
                want = hf.model.layers[0].mlp(x[None])[0]
        finally:
            with torch.no_grad():
                hf_router.copy_(saved)
        torch.testing.assert_close(_mlp_call(model, 0, x), want, atol=1e-5, rtol=1e-5)


# --- whole models -----------------------------------------------------------------------------


def test_batched_prefill_then_decode_matches_hf(moe, session):
    model_dir, hf = moe
    s = session(model_dir)
    seqs = [s.add(_prompt(n, seed=n)) for n in (5, 17, 1)]
    logits = s.logits([(q, None) for q in seqs])
    _assert_rows_match_hf(logits, seqs, hf)
    for _ in range(2):
        for q, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
            q.append_token(token)
        logits = s.logits([(q, 1) for q in seqs])
        _assert_rows_match_hf(logits, seqs, hf)


def test_chunked_prefill_and_greedy_match_generate(moe, session):
    model_dir, hf = moe
    s = session(model_dir)
    prompts = [_prompt(n, seed=10 + n) for n in (3, 12, 21)]
    seqs = [s.add(p) for p in prompts]
    num_new = 5
    s.step([(seqs[0], None), (seqs[2], 9)])  # third prompt chunked: 9, then 12
    s.step([(seqs[0], 1), (seqs[1], None), (seqs[2], None)])
    while any(q.num_output_tokens < num_new for q in seqs):
        s.step([(q, 1) for q in seqs if q.num_output_tokens < num_new])
    for q, p in zip(seqs, prompts, strict=True):
        assert q.token_ids[len(p) :] == hf_greedy(hf, p, num_new)


def test_prefix_shared_through_block_tables_matches_hf(moe, session):
    model_dir, hf = moe
    s = session(model_dir)
    prefix = _prompt(2 * BLOCK_SIZE, seed=5)
    first = s.add(prefix + _prompt(5, seed=6))
    second = s.add(prefix + _prompt(3, seed=7))
    _assert_rows_match_hf(s.logits([(first, None)]), [first], hf)
    second.block_table = first.block_table[:2]
    second.num_computed_tokens = len(prefix)
    _assert_rows_match_hf(s.logits([(second, None)]), [second], hf)


def test_triton_kernels_match_hf(checkpoint, session):
    """The GPU kernel set end to end (fused MoE included), in Triton's interpreter on CPU."""
    model_dir, hf = checkpoint("Qwen2MoeForCausalLM")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = session(model_dir, device=device, kernel_backend="triton")
    assert isinstance(s.runner.model.model.layers[0].mlp.experts, StackedExperts)
    seqs = [s.add(_prompt(n, seed=n)) for n in (9, 4)]
    _assert_rows_match_hf(s.logits([(q, None) for q in seqs]).cpu(), seqs, hf)
    for q in seqs:
        q.append_token(11)
    _assert_rows_match_hf(s.logits([(q, 1) for q in seqs]).cpu(), seqs, hf)


def test_decoder_sparse_step_makes_every_other_layer_sparse(checkpoint, session):
    model_dir, hf = checkpoint("Qwen3MoeForCausalLM", decoder_sparse_step=2, mlp_only_layers=[])
    s = session(model_dir)
    assert s.runner.model.args.sparse_layers == (False, True, False, True)
    seqs = [s.add(_prompt(n, seed=n)) for n in (6, 11)]
    _assert_rows_match_hf(s.logits([(q, None) for q in seqs]), seqs, hf)


def test_int8_experts_close_to_float(checkpoint, session):
    model_dir, hf = checkpoint("Qwen3MoeForCausalLM")
    s = session(model_dir, quantization="int8")
    block = s.runner.model.model.layers[0].mlp
    assert all(isinstance(e.down_proj, QuantizedLinear) for e in block.experts)
    assert isinstance(block.gate.weight, torch.nn.Parameter)  # the router stays float
    seqs = [s.add(_prompt(n, seed=n)) for n in (7, 18)]
    for row, q in zip(s.logits([(q, None) for q in seqs]), seqs, strict=True):
        ref = hf_next_logits(hf, q.token_ids)
        assert torch.corrcoef(torch.stack([row, ref]))[0, 1] > 0.99
        assert (row - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# --- checkpoint layouts -------------------------------------------------------------------------


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path, checkpoint):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) loads to the same weights as the hub's per-expert tensors, in both layouts."""
    model_dir, hf = checkpoint("Qwen2MoeForCausalLM")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    for backend in ("torch", "triton"):
        hub, stacked = _load(model_dir, backend, False), _load(tmp_path, backend, False)
        for (name, a), (_, b) in zip(
            hub.named_parameters(), stacked.named_parameters(), strict=True
        ):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    grouped = _load(model_dir, "torch", False).model.layers[2].mlp.experts[5]
    ref = hf.model.layers[2].mlp.experts
    torch.testing.assert_close(grouped.gate_up_proj.weight, ref.gate_up_proj[5], atol=0, rtol=0)
    torch.testing.assert_close(grouped.down_proj.weight, ref.down_proj[5], atol=0, rtol=0)


def test_missing_expert_tensor_is_named_as_in_the_checkpoint(tmp_path, checkpoint):
    model_dir, _ = checkpoint("MixtralForCausalLM")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="missing.*" + re.escape(name)):
            _load(tmp_path, backend)


def test_bfloat16_on_cpu_close_to_float32(checkpoint, session):
    model_dir, hf = checkpoint("Qwen2MoeForCausalLM")
    s = session(model_dir, dtype="bfloat16")
    assert s.runner.model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    seqs = [s.add(_prompt(n, seed=n)) for n in (7, 18)]
    for row, q in zip(s.logits([(q, None) for q in seqs]), seqs, strict=True):
        ref = hf_next_logits(hf, q.token_ids)
        assert torch.corrcoef(torch.stack([row, ref]))[0, 1] > 0.995
