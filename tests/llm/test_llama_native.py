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


def _both_paths(session, chunks, sampled_only=False) -> tuple:
    """One step's hidden states through `forward` as configured and with the fast path off (the
    step writes the same K/V to the same slots both times), then the step is taken. sampled_only:
    the states of the sampling rows (`output_rows`) and, last, all rows' states through the module
    path, selected afterwards."""
    runner = session.runner
    plan = session.plan(chunks)
    batch = runner.prepare_input(plan.scheduled)
    model = runner.model
    served = model.native is not None and NativeForward.serves(batch.meta, batch.lora)
    args = (batch.input_ids, batch.positions, batch.meta, runner.kv_pool.layer_caches, batch.lora)
    rows = batch.sample_indices
    kwargs = {"output_rows": rows} if sampled_only else {}
    with torch.inference_mode():
        fast = model(*args, **kwargs)
        native, model.native = model.native, None
        try:
            slow = model(*args, **kwargs)
            selected = (model(*args) if sampled_only else slow)[rows]
        finally:
            model.native = native
        tokens = model.compute_logits(selected).argmax(-1).tolist()
    session._advance(plan)
    next_token = dict(zip(batch.sample_seq_ids, tokens, strict=True))
    for item in plan.scheduled:
        if item.seq.seq_id in next_token:
            item.seq.append_token(next_token[item.seq.seq_id])
    return (served, fast, slow, selected) if sampled_only else (served, fast, slow)


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_output_rows_are_the_sampled_rows_states(checkpoint, session, dtype):
    # The last layer's MLP runs on the sampling rows alone (`output_rows`); their states are the
    # ones of the whole step's, on both paths, including a step with no sampling row at all (a
    # prompt's first chunk only) and steps whose rows are not in sampling order.
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
        served, fast, slow, selected = _both_paths(s, chunks, sampled_only=True)
        assert served
        assert fast.shape == (len(selected), s.runner.model.args.hidden_size)
        assert torch.equal(fast, slow)
        assert torch.equal(fast, selected)


def test_a_chunk_left_to_sdpa_takes_the_module_path(checkpoint, session):
    model_dir, _ = checkpoint("LlamaForCausalLM")
    s = session(model_dir)
    seq = s.add(_prompt(100, 0))
    _both_paths(s, [(seq, 40)])
    # 60 new tokens after a 40-token prefix: the plan gives this chunk to SDPA (kernels'
    # _native_takes), so the fast path does not serve the step; the output is the module path's.
    served, fast, slow, selected = _both_paths(s, [(seq, None)], sampled_only=True)
    assert not served
    assert torch.equal(fast, slow)
    assert torch.equal(fast, selected)


def test_not_built_where_a_piece_is_not_native(checkpoint, make_runner, monkeypatch):
    qwen3_dir, _ = checkpoint("Qwen3ForCausalLM")  # per-head q/k norms
    assert make_runner(qwen3_dir).model.native is None
    llama_dir, _ = checkpoint("LlamaForCausalLM")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton kernels on CPU (not a native piece)
    assert make_runner(llama_dir, kernel_backend="triton").model.native is None
    assert cpu_extension.load()
