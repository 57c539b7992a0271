"""The one Llama forward (backend_lib/llm/execution/models/llama.py) under its two kernel bindings
(models/step_kernels.py): straight calls of the C++ ops and the `KernelOps` wrappers give the same
hidden states, bit for bit, on the steps the C++ ops serve whole (prefill chunks, chunks after a
cached prefix, decodes; GQA, a sliding window, q/k/v biases, Qwen3's q/k norms; float32, bfloat16
and int8 weights; LoRA rows). `output_rows` gives the states of selecting afterwards, on a step
without sampling rows too; SDPA chunks and the Triton kernels run through the wrappers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from backend_lib.llm.execution.models.step_kernels import CppKernels, OpsKernels
from backend_lib.llm.lora.adapter import load_adapter
from backend_lib.llm.lora.request import LoRARequest
from kernels import cpu_extension
from tooling.lora_adapters import build_lora_adapter

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
SETTINGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "bfloat16-int8": {"dtype": "bfloat16", "quantization": "int8"},
}


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class _Step:
    binding: type
    """The binding the model picked for the step (CppKernels or OpsKernels)."""
    picked: torch.Tensor
    """The forward's states through that binding."""
    wrappers: torch.Tensor
    """The same forward's states through the KernelOps wrappers."""
    selected: torch.Tensor
    """Every row's states through the wrappers, the sampling rows selected afterwards."""


def _run_step(session, chunks, output_rows: bool = False) -> _Step:
    """One step's forward as the model picks its binding, then through the wrappers (the step
    writes the same K/V to the same slots each time); then the step is taken, its sampling
    sequences appending their greedy token. output_rows: both forwards return only the sampling
    rows (`output_rows`)."""
    runner = session.runner
    plan = session.plan(chunks)
    batch = runner.prepare_input(plan.scheduled)
    model = runner.model
    binding = type(model.step_kernels(batch.positions, batch.meta))
    args = (batch.input_ids, batch.positions, batch.meta, runner.kv_pool.layer_caches, batch.lora)
    rows = batch.sample_indices
    kwargs = {"output_rows": rows} if output_rows else {}
    with torch.inference_mode():
        picked = model(*args, **kwargs)
        cpp_ops, model.cpp_ops = model.cpp_ops, None  # None: the wrappers serve every step
        try:
            wrappers = model(*args, **kwargs)
            selected = (model(*args) if output_rows else wrappers)[rows]
        finally:
            model.cpp_ops = cpp_ops
        tokens = model.compute_logits(selected).argmax(-1).tolist()
    session._advance(plan)
    next_token = dict(zip(batch.sample_seq_ids, tokens, strict=True))
    for item in plan.scheduled:
        if item.seq.seq_id in next_token:
            item.seq.append_token(next_token[item.seq.seq_id])
    return _Step(binding, picked, wrappers, selected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_straight_calls_match_the_wrappers_bit_for_bit(checkpoint, session, arch, settings):
    model_dir, _ = checkpoint(arch)
    s = session(model_dir, **settings)
    assert s.runner.model.cpp_ops is not None  # the C++ library is built here (make setup)
    seqs = [s.add(_prompt(n, seed)) for seed, n in enumerate((11, 23, 6))]
    steps = [
        [(seqs[0], None), (seqs[1], 9), (seqs[2], None)],  # whole prompts and a first chunk
        [(seqs[0], None), (seqs[1], None), (seqs[2], None)],  # decodes and a chunk after a prefix
        [(seqs[0], None), (seqs[1], None), (seqs[2], None)],  # decodes
    ]
    for chunks in steps:
        step = _run_step(s, chunks)
        assert step.binding is CppKernels
        assert torch.equal(step.picked, step.wrappers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_output_rows_are_the_sampled_rows_states(checkpoint, session, dtype):
    # The last layer's MLP runs on the sampling rows alone (`output_rows`); their states are the
    # ones of the whole step's, through both bindings, including a step with no sampling row at
    # all (a prompt's first chunk only) and steps whose rows are not in sampling order.
    model_dir, _ = checkpoint("LlamaForCausalLM")
    s = session(model_dir, dtype=dtype)
    seqs = [s.add(_prompt(n, seed)) for seed, n in enumerate((11, 23, 6))]
    steps = [
        [(seqs[1], 9)],  # no sampling row
        [(seqs[0], None), (seqs[1], None), (seqs[2], 4)],  # prompts, a chunk after a prefix
        [(seqs[2], None), (seqs[0], None), (seqs[1], None)],  # decodes and the last chunk
        [(seqs[0], None), (seqs[1], None), (seqs[2], None)],  # decodes
    ]
    for chunks in steps:
        step = _run_step(s, chunks, output_rows=True)
        assert step.binding is CppKernels
        assert step.picked.shape == (len(step.selected), s.runner.model.args.hidden_size)
        assert torch.equal(step.picked, step.wrappers)
        assert torch.equal(step.picked, step.selected)


def test_a_chunk_left_to_sdpa_runs_through_the_wrappers(checkpoint, session):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    s = session(model_dir)
    seq = s.add(_prompt(100, 0))
    _run_step(s, [(seq, 40)])
    # 60 new tokens after a 40-token prefix: the plan gives this chunk to SDPA (kernels'
    # _native_takes), so the step goes through the wrappers.
    step = _run_step(s, [(seq, None)], output_rows=True)
    assert step.binding is OpsKernels
    assert torch.equal(step.picked, step.selected)


def test_lora_rows_match_the_wrappers_and_select_at_the_end(checkpoint, session, tmp_path):
    model_dir, hf = checkpoint("Qwen2ForCausalLM")
    s = session(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    path = tmp_path / "adapter"
    build_lora_adapter(hf, path, rank=8, alpha=16, seed=3, b_std=0.2)
    adapter = load_adapter("a", path, s.runner.lora_spec, 8)
    prompt = _prompt(13, 0)
    base, tuned = s.add(prompt), s.add(prompt)
    tuned.lora_request = LoRARequest("a", 1, str(path), adapter)
    other = s.add(_prompt(7, 1))
    steps = [
        [(base, None), (tuned, None), (other, 4)],  # prompts and a first chunk
        [(base, None), (tuned, None), (other, None)],  # decodes and a chunk after a prefix
        [(base, None), (tuned, None), (other, None)],  # decodes
    ]
    for chunks in steps:
        step = _run_step(s, chunks, output_rows=True)
        assert step.binding is CppKernels
        assert torch.equal(step.picked, step.wrappers)
        assert torch.equal(step.picked, step.selected)
        # The same prompt under the adapter and without: the adapter's rows differ.
        assert not torch.equal(step.picked[0], step.picked[1])


def test_straight_calls_only_where_the_cpp_ops_take_the_model(checkpoint, make_runner, monkeypatch):
    qwen3_dir, _ = checkpoint("Qwen3ForCausalLM")  # per-head q/k norms: straight calls too
    assert make_runner(qwen3_dir).model.cpp_ops is not None
    llama_dir, _ = checkpoint("LlamaForCausalLM")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton kernels on CPU (not the C++ ops)
    assert make_runner(llama_dir, kernel_backend="triton").model.cpp_ops is None
    assert cpu_extension.load()
