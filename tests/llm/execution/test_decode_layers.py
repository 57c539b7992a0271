"""A decode step's layers in one C++ call (models/decode_layers.py): the same bits as the Python
layer loop over the same ops (states and KV caches), greedy tokens equal to transformers', and the
call bound only for plain layers with blocked-GEMV projections."""

from __future__ import annotations

import pytest
import torch

from backend_lib.llm.execution.models.step_kernels import CppKernels
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt
from tooling.hf_reference import hf_greedy


def _decode_run(session, model_dir, one_call: bool, **settings):
    """Two prompts prefilled, then four steps of their decodes in reversed (non-sampling) order;
    each step's sampled rows' states, the calls of the one-call path, the KV caches after."""
    s = session(model_dir, **settings)
    runner, model = s.runner, s.runner.model
    assert model.decode_layers is not None  # bound: float32 packs into blocked GEMVs here
    if not one_call:
        model.decode_layers = None
    calls = []
    original = CppKernels.decode_layers

    def counted(self, *args):
        calls.append(len(args[1]))
        return original(self, *args)

    seqs = [s.add(random_prompt(n, seed)) for seed, n in enumerate((13, 6))]
    s.step([(seq, None) for seq in seqs])
    states = []
    try:
        CppKernels.decode_layers = counted
        for _ in range(4):
            plan = s.plan([(seqs[1], None), (seqs[0], None)])
            batch = runner.prepare_input(plan.scheduled)
            with torch.inference_mode():
                hidden = model(
                    batch.input_ids,
                    batch.positions,
                    batch.meta,
                    runner.kv_pool.layer_caches,
                    output_rows=batch.sample_indices,
                )
            states.append(hidden.clone())
            s._advance(plan)
            for seq, token in zip(seqs, model.compute_logits(hidden).argmax(-1), strict=False):
                seq.append_token(int(token))
    finally:
        CppKernels.decode_layers = original
    caches = [t.clone() for kv in runner.kv_pool.layer_caches for t in kv]
    return states, calls, caches


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_one_call_matches_the_python_loop_bit_for_bit(checkpoint, session, arch):
    """GQA, a sliding window (Mistral), q/k/v biases (Qwen2)."""
    model_dir, _ = checkpoint(arch)
    states, calls, caches = _decode_run(session, model_dir, one_call=True)
    loop_states, loop_calls, loop_caches = _decode_run(session, model_dir, one_call=False)
    assert calls == [2, 2, 2, 2] and loop_calls == []
    for one, loop in zip(states, loop_states, strict=True):
        assert torch.equal(one, loop)
    for one, loop in zip(caches, loop_caches, strict=True):
        assert torch.equal(one, loop)


def test_engine_decodes_through_one_call_as_transformers_does():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    assert engine.runner.model.decode_layers is not None
    prompts = [random_prompt(n, 40 + n) for n in (5, 11, 3)]
    outs = engine.generate(prompts, greedy(7))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 7) for p in prompts]


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("Qwen3ForCausalLM", {}),  # per-head q/k norms
        ("Gemma2ForCausalLM", {}),  # soft-cap, extra norms, GELU
        ("Qwen2MoeForCausalLM", {}),  # a mixture-of-experts MLP
        ("LlamaForCausalLM", {"quantization": "int8"}),  # not blocked-GEMV projections
        ("LlamaForCausalLM", {"kernel_backend": "triton"}),  # no C++ ops
    ],
)
def test_only_plain_layers_with_blocked_gemvs_bind(checkpoint, make_runner, arch, settings):
    model_dir, _ = checkpoint(arch)
    assert make_runner(model_dir, **settings).model.decode_layers is None


def test_steps_past_the_gemv_rows_run_the_python_loop(checkpoint, make_runner):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    layers = make_runner(model_dir).model.decode_layers
    caches = [(torch.empty(1), torch.empty(1))]
    assert layers.max_rows == 16  # float32's blocked-GEMV rows
    assert layers.takes(16, caches) and not layers.takes(17, caches)
    assert not layers.takes(1, [(torch.empty(1),) * 4])  # an 8-bit cache's scales
