"""The CPU fast path of the Llama forward (backend_lib/llm/execution/models/llama_native.py): the
same hidden states, bit for bit, as the module path on the steps it serves (prefill chunks, chunks
after a cached prefix, decodes; GQA, a sliding window, q/k/v biases; float32, bfloat16 and int8
weights), the steps it leaves to the module path, and the models it is not built for."""

from __future__ import annotations

import pytest
import torch

from backend_lib.llm.execution.models.llama_native import NativeForward
from kernels import cpu_extension

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _both_paths(session, chunks) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """One step's hidden states through `forward` as configured and with the fast path off (the
    step writes the same K/V to the same slots both times), then the step is taken."""
    runner = session.runner
    plan = session.plan(chunks)
    batch = runner.prepare_input(plan.scheduled)
    model = runner.model
    served = model.native is not None and NativeForward.serves(batch.meta, batch.lora)
    args = (batch.input_ids, batch.positions, batch.meta, runner.kv_pool.layer_caches, batch.lora)
    with torch.inference_mode():
        fast = model(*args)
        native, model.native = model.native, None
        try:
            slow = model(*args)
        finally:
            model.native = native
        tokens = model.compute_logits(fast[batch.sample_indices]).argmax(-1).tolist()
    session._advance(plan)
    next_token = dict(zip(batch.sample_seq_ids, tokens, strict=True))
    for item in plan.scheduled:
        if item.seq.seq_id in next_token:
            item.seq.append_token(next_token[item.seq.seq_id])
    return served, fast, slow


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "settings",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "float32", "quantization": "int8"},
        {"dtype": "bfloat16", "quantization": "int8"},
    ],
    ids=["float32", "bfloat16", "int8", "bfloat16-int8"],
)
def test_fast_path_matches_the_module_path_bit_for_bit(checkpoint, session, arch, settings):
    model_dir, _ = checkpoint(arch)
    s = session(model_dir, **settings)
    assert s.runner.model.native is not None  # the C++ library is built here (make setup)
    seqs = [s.add(_prompt(n, seed)) for seed, n in enumerate((11, 23, 6))]
    steps = [
        [(seqs[0], None), (seqs[1], 9), (seqs[2], None)],  # whole prompts and a first chunk
        [(seqs[0], None), (seqs[1], None), (seqs[2], None)],  # decodes and a chunk after a prefix
        [(seqs[0], None), (seqs[1], None), (seqs[2], None)],  # decodes
    ]
    for chunks in steps:
        served, fast, slow = _both_paths(s, chunks)
        assert served
        assert torch.equal(fast, slow)


def test_a_chunk_left_to_sdpa_takes_the_module_path(checkpoint, session):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    s = session(model_dir)
    seq = s.add(_prompt(100, 0))
    _both_paths(s, [(seq, 40)])
    # 60 new tokens after a 40-token prefix: the plan gives this chunk to SDPA (kernels'
    # _native_takes), so the fast path does not serve the step; the output is the module path's.
    served, fast, slow = _both_paths(s, [(seq, None)])
    assert not served
    assert torch.equal(fast, slow)


def test_not_built_where_a_piece_is_not_native(checkpoint, make_runner, monkeypatch):
    qwen3_dir, _ = checkpoint("Qwen3ForCausalLM")  # per-head q/k norms
    assert make_runner(qwen3_dir).model.native is None
    llama_dir, _ = checkpoint("LlamaForCausalLM")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton kernels on CPU (not a native piece)
    assert make_runner(llama_dir, kernel_backend="triton").model.native is None
    assert cpu_extension.load()
