"""Captured decode steps (execution/decode_graphs.py): which steps the graphs take, the padded
buckets, and greedy tokens equal to transformers' through them.

On CUDA (LLM_TEST_DEVICE=cuda, `make gpu-check`) the engine captures real CUDA graphs by default.
On the CPU, which never captures, the same buffers, buckets and padding are replayed eagerly (the
capture step is the identity), so everything but the graph itself is checked here too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.cuda_graph_config import default_capture_sizes
from backend_lib.llm.execution.decode_graphs import DecodeBuffers, DecodeGraphs, graphs_apply
from backend_lib.llm.execution.step_batch import StepBatcher
from kernels import kernel_ops
from tests.llm.config_helpers import llm_config
from tests.llm.engine_helpers import (
    TEST_DEVICE,
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    output_ids,
    random_prompt,
)
from tooling.hf_reference import hf_greedy


def _graphed_engine(arch: str, sizes: tuple[int, ...], **overrides):
    """An engine whose decode steps go through graphs of `sizes`, and the buckets each replay
    ran, in order."""
    model_dir, hf = engine_checkpoint(arch)
    text = ",".join(map(str, sizes))
    engine = make_engine(model_dir, cudagraph_capture_sizes=text, **overrides)
    runner = engine.runner
    if TEST_DEVICE.type == "cuda":
        assert runner.decode_graphs is not None  # captured by default
    else:
        assert runner.decode_graphs is None  # the CPU runs eagerly; replay the same buckets
        runner.decode_graphs = runner.capture_decode_graphs(sizes, capture=lambda forward: forward)
    graphs, used = runner.decode_graphs, []
    for rows, replay in list(graphs.replays.items()):
        graphs.replays[rows] = lambda rows=rows, replay=replay: used.append(rows) or replay()
    return engine, hf, used


# The CPU runs both kernel sets (Triton's as the GPU runs it, interpreted); CUDA runs Triton's.
_FAMILIES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Qwen2MoeForCausalLM")
_CASES = [("LlamaForCausalLM", "triton"), *((arch, "torch") for arch in _FAMILIES)]
if TEST_DEVICE.type == "cuda":
    _CASES = [(arch, "triton") for arch in ("LlamaForCausalLM", *_FAMILIES)]


@pytest.mark.parametrize("arch, backend", _CASES)
def test_decode_steps_replay_padded_buckets_and_match_transformers(arch, backend):
    engine, hf, used = _graphed_engine(arch, (1, 2, 4), kernel_backend=backend)
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 17, 9))]
    lengths = (9, 4, 6)  # three decodes (bucket 4, one padding row), then two, then one
    outs = engine.generate(prompts, [greedy(n) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n)
    assert {4, 2, 1} <= set(used)
    assert_pool_released(engine)


def test_steps_the_graphs_do_not_take_run_eagerly_with_the_same_tokens():
    """Prefill chunks, and decode steps past the largest bucket, run the eager forward."""
    engine, hf, used = _graphed_engine("LlamaForCausalLM", (1, 2), max_num_batched_tokens=8)
    prompts = [random_prompt(n, 10 + n) for n in (3, 12, 6, 4)]  # a 12-token prompt: two chunks
    assert output_ids(engine, prompts, greedy(5)) == [hf_greedy(hf, p, 5) for p in prompts]
    assert used and set(used) <= {1, 2}  # four decodes at once never replayed
    assert_pool_released(engine)


def test_padding_rows_store_nothing_and_read_one_key():
    buffers = DecodeBuffers.allocate(4, 3, 8, torch.device("cpu"))
    batcher = StepBatcher(torch.device("cpu"), 8, kernel_ops("torch"), lora=None)
    batch = batcher.flat_input(
        tokens=np.array([7, 8]),
        starts=np.array([10, 3]),
        q_lens=np.array([1, 1]),
        block_tables=[[5, 6], [2]],
        sample_indices=[1, 0],
    )
    buffers.fill(batch, 4)
    assert buffers.input_ids.tolist() == [7, 8, 0, 0]
    assert buffers.positions.tolist() == [10, 3, 0, 0]
    assert buffers.slot_mapping.tolist()[2:] == [-1, -1]
    assert buffers.slot_mapping.tolist()[:2] == [6 * 8 + 2, 2 * 8 + 3]  # block size 8
    assert buffers.seq_lens.tolist() == [11, 4, 1, 1]
    assert buffers.block_tables[:2, :2].tolist() == [[5, 6], [2, 0]]
    assert buffers.block_tables[2:, 0].tolist() == [0, 0]
    meta = buffers.meta(4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1
    assert meta.max_seq_len == 3 * 8


def test_a_bucket_holds_the_fewest_padding_rows():
    graphs = DecodeGraphs(
        lambda ids, pos, meta: ids.float(), (8, 1, 4, 4), 2, 8, torch.device("cpu"), lambda f: f
    )
    assert graphs.sizes == (1, 4, 8)
    assert [graphs.bucket(b) for b in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]


def test_capture_sizes_parse_as_vllm_defaults_them():
    assert default_capture_sizes(64) == (1, 2, 4, *range(8, 65, 8))
    assert default_capture_sizes(100)[-1] == 104  # the first bucket that holds max_num_seqs
    assert default_capture_sizes(2000)[-1] == 512
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    assert llm_config(model_dir, cudagraph_capture_sizes="8, 1,4,4").capture_sizes == (1, 4, 8)
    assert llm_config(model_dir, max_num_seqs=4).capture_sizes == (1, 2, 4)
    for bad in ("1,two", "0,4"):
        with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
            llm_config(model_dir, cudagraph_capture_sizes=bad)


def test_graphs_apply_on_one_cuda_rank_with_the_triton_kernels_unless_eager():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    cuda, triton = torch.device("cuda"), kernel_ops("triton")
    assert graphs_apply(llm_config(model_dir), cuda, triton)
    assert not graphs_apply(llm_config(model_dir, enforce_eager=True), cuda, triton)
    assert not graphs_apply(llm_config(model_dir, tensor_parallel_size=2), cuda, triton)
    assert not graphs_apply(llm_config(model_dir), cuda, kernel_ops("torch"))  # a host plan
    assert not graphs_apply(llm_config(model_dir), torch.device("cpu"), triton)
