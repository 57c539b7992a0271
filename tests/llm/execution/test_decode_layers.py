"""A decode step's layers in one C++ call (models/decode_layers.py): the same bits as the Python
layer loop over the same ops (states and KV caches), greedy tokens equal to transformers', and the
call bound only for plain layers whose projections the C++ library runs (blocked GEMVs, WNA16)."""

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
    assert model.decode_layers is not None  # bound: blocked GEMVs or C++ WNA16 kernels here
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


@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory):
    """A random Llama written as a Q4_K GGUF (4-bit groups of 32 with float minimums, which the
    C++ kernel folds into its zero points), as the engine converts it."""
    from backend_lib.gguf_checkpoint import materialize
    from tooling.gguf_checkpoints import build_family_checkpoint, write_gguf

    root = tmp_path_factory.mktemp("q4_k")
    path = write_gguf(
        build_family_checkpoint("LlamaForCausalLM", root / "llama"), root / "q4_k.gguf", "Q4_K"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        return materialize(path, str(path))


@pytest.mark.parametrize(
    "source, settings",
    [
        ("W4A16_G64_ASYM", {}),  # 4-bit groups with zero points
        ("W8A16_CHANNEL", {}),  # 8-bit, one scale a row
        ("Q4_K", {}),  # float minimums folded into the zero points
        ("W4A16_G64_ASYM", {"w4a16_activations": "int8"}),  # the int8 dot
    ],
    ids=["w4a16-g64-asym", "w8a16-channel", "gguf-q4_k", "w4a16-int8-activations"],
)
def test_wna16_projections_take_the_one_call_with_the_python_loops_bits(
    session, q4_k_gguf, source, settings
):
    """A pre-quantized checkpoint on the C++ WNA16 kernel: the one call makes the loop's
    `wna16_linear` calls (bits, groups, GEMM crossover and int8 activations alike)."""
    from tests.llm.quantized_checkpoint_helpers import quantized_shakespeare

    if settings.get("w4a16_activations") == "int8" and not torch.ops.llm_cpu.wna16_int8_dot():
        pytest.skip("this CPU has no int8 dot for the WNA16 kernel (AVX-512 without VNNI)")
    model_dir = q4_k_gguf if source == "Q4_K" else quantized_shakespeare(source)
    states, calls, caches = _decode_run(session, model_dir, one_call=True, **settings)
    loop_states, loop_calls, loop_caches = _decode_run(
        session, model_dir, one_call=False, **settings
    )
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
def test_only_plain_layers_with_cpp_projections_bind(checkpoint, make_runner, arch, settings):
    model_dir, _ = checkpoint(arch)
    assert make_runner(model_dir, **settings).model.decode_layers is None


def test_steps_past_the_gemv_rows_run_the_python_loop(checkpoint, make_runner):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    layers = make_runner(model_dir).model.decode_layers
    caches = [(torch.empty(1), torch.empty(1))]
    assert layers.max_rows == 16  # float32's blocked-GEMV rows
    assert layers.takes(16, caches) and not layers.takes(17, caches)
    assert not layers.takes(1, [(torch.empty(1),) * 4])  # an 8-bit cache's scales
