"""The C++ CPU paged attention (kernels/csrc/paged_attention_cpu.cpp): the op against the float64
per-token reference of attention_helpers.py, the routing of `paged_attention_cpu` between the op
and SDPA, the loader's refusals and the fallback to the PyTorch path, and that this machine really
runs the op (a silent fallback would pass every other test).

Tolerances (relative: max |got - want| / max |want|, conftest.TOLERANCE): float32 1e-5, float16
2e-3, bfloat16 1.6e-2 against the float64 reference rounded to the dtype.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels import cpu_extension, kernel_ops
from kernels.paged_attention import (
    paged_attention_cpu,
    paged_attention_torch,
    plan_paged_attention_cpu,
    plan_paged_attention_torch,
)
from tests.kernels.attention_helpers import CASES, Case, Inputs, make_inputs, naive_attention

# Not `dtype`: tests/kernels/conftest.py parametrizes that name itself (and skips bfloat16 on CPU,
# where only Triton's interpreter mishandles it).
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]

# Beyond attention_helpers.CASES: block sizes 8/16/32, head_dim 16/32/64/128/80 and 20 (not a
# multiple of the vector width: the scalar tails), GQA 1/2/4, MQA, windows inside prefill tiles,
# chunks longer than one query tile after a prefix, contexts crossing many 32-key chunks.
OP_CASES = {
    **CASES,
    "decode-only-gqa2-b32-d32": Case((1,) * 6, (1, 31, 32, 33, 64, 200), 4, 2, 32, 32),
    "decode-only-mha-b16-d16": Case((1,) * 4, (5, 16, 17, 90), 4, 4, 16, 16),
    "prefill-only-gqa4-d64": Case((9, 20, 3), (9, 20, 3), 8, 2, 64, 16),
    "mixed-mqa-b32-d128": Case((1, 13, 1, 2), (70, 13, 5, 40), 4, 1, 128, 32),
    "chunked-prefill-b8-d80": Case((17, 5, 1), (50, 41, 66), 8, 4, 80, 8),
    "head-dim-20-tails": Case((1, 6, 1), (23, 6, 47), 6, 3, 20, 8),
    "window-in-prefill-tiles": Case((24, 1, 9), (60, 100, 9), 8, 2, 64, 16, sliding_window=7),
    "window-wider-than-context": Case((3, 1), (10, 12), 4, 2, 32, 8, sliding_window=50),
    "window-1": Case((4, 1), (9, 33), 4, 2, 32, 8, sliding_window=1),
    "long-contexts": Case((1, 1, 40), (700, 333, 400), 8, 2, 64, 16),
    # 8 kv heads of head_dim 128: more than one item's accumulators hold, so items take kv heads
    # in groups (kItemAccFloats).
    "mha-8-kv-heads-in-groups-d128": Case((1, 5, 1, 20), (40, 5, 70, 30), 8, 8, 128, 16),
}


@pytest.fixture(scope="module")
def op(cpu_kernels):
    """torch.ops.llm_cpu.paged_attention (conftest's cpu_kernels: fails when unbuilt though a
    compiler exists)."""
    return cpu_kernels.paged_attention


def _all_seqs(inputs: Inputs) -> torch.Tensor:
    return torch.arange(inputs.seq_lens.shape[0], dtype=torch.int32)


def _run_op(op, inputs: Inputs, seqs: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full_like(inputs.q, float("nan"))
    op(
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.query_start_loc,
        inputs.seq_lens,
        inputs.block_tables,
        inputs.scale,
        inputs.sliding_window or 0,
        _all_seqs(inputs) if seqs is None else seqs,
        out,
    )
    return out


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_op_matches_float64_reference(op, case, cpu_dtype, assert_close):
    # Every sequence through the op, long chunks included (the routing would send those to SDPA).
    inputs = make_inputs(case, cpu_dtype, torch.device("cpu"))
    assert_close(_run_op(op, inputs), naive_attention(inputs).to(cpu_dtype), cpu_dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_op_reads_zero_padded_tables_and_strided_queries(op, block_size, assert_close):
    # The engine pads tables with block 0 (a live block of another sequence) and passes q as a view
    # into the fused qkv projection.
    case = Case((1, 4, 1), (30, 4, 75), 8, 2, 64, block_size)
    inputs = make_inputs(case, torch.float32, torch.device("cpu"))
    inputs.block_tables = inputs.block_tables.clamp_min(0)
    fused = torch.randn(inputs.q.shape[0], 3 * case.num_heads, case.head_dim)
    fused[:, : case.num_heads] = inputs.q
    inputs.q = fused[:, : case.num_heads]
    assert_close(_run_op(op, inputs), naive_attention(inputs).float(), torch.float32)


def test_op_writes_only_the_listed_sequences(op):
    inputs = make_inputs(CASES["mixed-prefill-decode-d96"], torch.float32, torch.device("cpu"))
    out = _run_op(op, inputs, torch.tensor([1, 3], dtype=torch.int32))
    starts = inputs.query_start_loc.tolist()
    for b in range(4):
        rows = out[starts[b] : starts[b + 1]]
        assert rows.isnan().all() if b in (0, 2) else not rows.isnan().any(), b


def test_op_refuses_out_of_range_block_ids(op):
    inputs = make_inputs(CASES["gqa4-d128"], torch.float32, torch.device("cpu"))
    inputs.block_tables[1, 0] = inputs.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        _run_op(op, inputs)
    inputs.block_tables[1, 0] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        _run_op(op, inputs)


def test_op_refuses_mixed_dtypes(op):
    inputs = make_inputs(CASES["gqa4-d128"], torch.float32, torch.device("cpu"))
    inputs.k_cache = inputs.k_cache.bfloat16()
    with pytest.raises(RuntimeError, match="share a dtype"):
        _run_op(op, inputs)


@pytest.mark.parametrize("threads", [1, 2])
def test_op_gives_the_same_result_on_any_thread_count(op, threads):
    inputs = make_inputs(OP_CASES["long-contexts"], torch.float32, torch.device("cpu"))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = _run_op(op, inputs)
        torch.set_num_threads(threads)
        assert torch.equal(_run_op(op, inputs), want)  # each item is one thread's: bitwise equal
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cpu_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_cpu_entry_matches_float64_reference(op, case, cpu_dtype, assert_close):
    # The "torch" backend's entry: the op for decodes and short or fresh chunks, SDPA for the rest.
    inputs = make_inputs(case, cpu_dtype, torch.device("cpu"))
    plan = plan_paged_attention_cpu(
        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache
    )
    assert plan.native_seqs is not None
    out = torch.full_like(inputs.q, float("nan"))
    got = paged_attention_cpu(*inputs.args(), out=out, plan=plan)
    assert got is out
    assert_close(got, naive_attention(inputs).to(cpu_dtype), cpu_dtype)


def test_routing_sends_decodes_short_and_fresh_chunks_to_the_op():
    # Sequences: decode, 16-token chunk after a prefix, 17-token chunk after a long prefix (SDPA),
    # a fresh 300-token prompt, a 600-token one (SDPA), a 100-token chunk after a 20-token prefix.
    query_lens = [1, 16, 17, 300, 600, 100]
    context_lens = [50, 500, 500, 300, 600, 120]
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    k_cache = torch.zeros(80, 16, 2, 8)
    tables = torch.zeros(len(query_lens), 40, dtype=torch.int32)
    args = (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32),
        tables,
        k_cache,
    )
    plan = plan_paged_attention_torch(*args, native=True)
    assert plan.native_seqs.tolist() == [0, 1, 3, 5]
    assert [p.start for p in plan.prefills] == [starts[2], starts[4]]
    assert plan.decode_groups == []
    assert plan_paged_attention_torch(*args).native_seqs is None


def test_torch_backend_runs_the_op_on_this_machine(op, monkeypatch, assert_close):
    """The op is built, loaded and called by the "torch" backend: a silent fallback fails here."""
    assert cpu_extension.check_build() is None
    calls = []

    def spy(*args):
        calls.append(args[-2].tolist())
        return op(*args)

    monkeypatch.setattr(torch.ops.llm_cpu, "paged_attention", spy)
    ops = kernel_ops("torch")
    inputs = make_inputs(CASES["mixed-prefill-decode-d96"], torch.float32, torch.device("cpu"))
    plan = ops.plan_attention(
        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache
    )
    got = ops.paged_attention(*inputs.args(), plan=plan)
    assert calls == [[0, 1, 2, 3]]
    assert plan.decode_groups == [] and plan.prefills == []
    assert_close(got, naive_attention(inputs).float(), torch.float32)


def test_unloadable_op_falls_back_to_the_pytorch_path(monkeypatch, assert_close):
    monkeypatch.setattr(cpu_extension, "load", lambda: False)
    inputs = make_inputs(CASES["mixed-prefill-decode-d96"], torch.float32, torch.device("cpu"))
    plan = plan_paged_attention_cpu(
        inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.k_cache
    )
    assert plan.native_seqs is None
    assert len(plan.decode_groups) + len(plan.prefills) == 4
    got = paged_attention_cpu(*inputs.args(), plan=plan)
    torch.testing.assert_close(got, paged_attention_torch(*inputs.args()), rtol=0, atol=0)


def test_mixed_dtypes_fall_back_to_the_pytorch_path(op, assert_close):
    # The plan is built from k_cache alone; a float32 q over a bfloat16 cache is the op's refusal,
    # so the entry re-plans everything for PyTorch instead of failing.
    inputs = make_inputs(CASES["gqa4-d128"], torch.bfloat16, torch.device("cpu"))
    inputs.q = inputs.q.float()
    got = paged_attention_cpu(*inputs.args())
    assert got.dtype == torch.float32
    assert_close(got, paged_attention_torch(*inputs.args()), torch.float32)


def test_loader_refuses_missing_stale_foreign_and_broken_builds(tmp_path, monkeypatch):
    assert "not built" in cpu_extension.check_build(tmp_path)
    (tmp_path / cpu_extension.LIBRARY).write_bytes(b"not a shared library")
    good = {**cpu_extension._expected_manifest(), "isa": "default"}
    manifest = tmp_path / cpu_extension.MANIFEST

    manifest.write_text("{", encoding="utf-8")
    assert "unreadable manifest" in cpu_extension.check_build(tmp_path)
    for key in ("torch", "sources"):
        manifest.write_text(cpu_extension.json.dumps({**good, key: "other"}), encoding="utf-8")
        assert f"stale build ({key} changed" in cpu_extension.check_build(tmp_path)
    manifest.write_text(cpu_extension.json.dumps({**good, "isa": "avx512"}), encoding="utf-8")
    monkeypatch.setattr(cpu_extension, "_cpu_isa", lambda: "avx2")
    assert "built for 'avx512'" in cpu_extension.check_build(tmp_path)

    manifest.write_text(cpu_extension.json.dumps(good), encoding="utf-8")
    assert cpu_extension.check_build(tmp_path) is None
    assert "failed to load" in cpu_extension.load_from(tmp_path)


_FALLBACK_PROCESS = """
import math, sys
import torch
from kernels import cpu_extension
cpu_extension.BUILD_DIR = cpu_extension.Path(sys.argv[1])  # empty: nothing built
from kernels import kernel_ops
ops = kernel_ops("torch")
q = torch.randn(3, 4, 16)
k = torch.randn(4, 8, 2, 16)
v = torch.randn(4, 8, 2, 16)
meta = (torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([9, 2], dtype=torch.int32),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
for _ in range(2):
    plan = ops.plan_attention(*meta, k)
    out = ops.paged_attention(q, k, v, *meta, 0.25, plan=plan)
    assert plan.native_seqs is None and not out.isnan().any()
print("fallback ok")
"""


def test_fresh_process_without_a_build_serves_through_pytorch_and_says_why_once(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _FALLBACK_PROCESS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cpu_extension.BUILD_DIR.parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "fallback ok"
    reasons = [line for line in result.stderr.splitlines() if "C++ CPU kernels unavailable" in line]
    assert len(reasons) == 1 and "not built" in reasons[0], result.stderr[-3000:]


def test_engine_gives_the_same_greedy_tokens_with_the_op_and_without(op, monkeypatch):
    # float32 engine over prefills, chunked prefills, prefix-cache hits and decodes in mixed batches.
    from kernels import paged_attention
    from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt

    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    shared = random_prompt(12, seed=1)
    prompts = [shared + random_prompt(5, seed=2), shared + random_prompt(9, seed=3)]
    prompts += [random_prompt(n, seed=4 + n) for n in (3, 30, 41)]
    outputs = {}
    for native in (True, False):
        monkeypatch.setattr(paged_attention, "_native_usable", lambda k_cache, n=native: n)
        engine = make_engine(model_dir, kernel_backend="torch", max_num_batched_tokens=24)
        first = engine.generate(prompts[:1], greedy(8))
        rest = engine.generate(prompts[1:], greedy(8))
        outputs[native] = [o.outputs[0].token_ids for o in first + rest]
        assert engine.stats().counters.prefix_cache_hits > 0
    assert outputs[True] == outputs[False]
