"""Pipeline parallelism on CPU with gloo (issue 26): the engine's process is stage 0 and drives
the other stages as worker processes (execution/workers.py), activations passing stage to stage.
On Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms), Mixtral (experts) and Phi-3 (fused
checkpoint projections) shapes PP=2, and on a three-layer Llama split unevenly TP=2 x PP=2, give
the tokens of one rank (so of transformers) with chunked prefill, prefix-cache hits, seeded
sampling with n > 1 and structured outputs (Llama and TP=2 x PP=2 with preemption by recompute
and swap too), and prompt logprobs within 1e-5 of one rank's."""

from __future__ import annotations

import os

import pytest

from backend_lib.config import ConfigError
from backend_lib.llm.execution.pipeline_parallel import PipelineStage, stage_layers
from tests.llm.engine_helpers import engine_checkpoint, make_engine
from tests.llm.tensor_parallel_helpers import engine_workload, variant_checkpoint, worker_pids
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
)
"""Llama runs the whole workload (with preemption); the others the workload of one engine."""
KEYS = ("chunked", "prefix", "sampled", "structured")
PREEMPTION_KEYS = ("recompute", "swap")


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """A tiny Llama with three decoder layers: two stages hold one and two."""
    return variant_checkpoint(tmp_path_factory.mktemp("three-layers"), num_hidden_layers=3)


def test_layers_split_evenly_with_the_remainder_on_the_last_stages():
    assert [list(stage_layers(3, s, 2)) for s in range(2)] == [[0], [1, 2]]
    assert [len(stage_layers(10, s, 4)) for s in range(4)] == [2, 2, 3, 3]
    assert [list(stage_layers(4, s, 4)) for s in range(4)] == [[0], [1], [2], [3]]
    first, last = PipelineStage(0, 2), PipelineStage(1, 2)
    for name, on_first in (
        ("model.embed_tokens.weight", True),
        ("lm_head.weight", True),
        ("model.layers.0.mlp.up_proj.weight", True),
        ("model.layers.1.self_attn.q_proj.weight", False),
        ("model.norm.weight", False),
    ):
        assert first.holds(name, 3) is on_first and last.holds(name, 3) is not on_first, name
    # Ranks are numbered tensor-parallel rank innermost: rank 3 of TP=2 x PP=2 is stage 1's rank 1.
    assert PipelineStage.of_rank(3, 2, 2) == PipelineStage(1, 2, 1, 2)


def _assert_same(result: dict, single: dict) -> None:
    for key in KEYS:
        assert result[key] == single[key], key
    assert result["prefix_cached_tokens"] >= 16
    if "swap" in single:
        for key in PREEMPTION_KEYS:
            assert result[key] == single[key], key
        assert result["recompute_preemptions"] > 0 and result["swap_preemptions"] > 0
    for got, want in zip(result["prompt_logprobs"], single["prompt_logprobs"], strict=True):
        if want is None:
            assert got is None
            continue
        assert got.keys() == want.keys()
        assert max(abs(got[t] - want[t]) for t in want) <= 1e-5


@pytest.mark.sample(2)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_two_stages_give_the_tokens_of_one_rank(arch):
    model_dir, hf = engine_checkpoint(arch)
    settings = {"logits": False, "preemption": arch == "LlamaForCausalLM"}
    single = engine_workload(str(model_dir), 1, **settings)
    staged = engine_workload(str(model_dir), 1, pipeline_parallel_size=2, **settings)
    _assert_same(staged, single)
    assert single["chunked"] == [hf_greedy(hf, p, 6) for p in single["prompts"]]
    assert worker_pids(os.getpid()) == []


def test_two_stages_of_two_tensor_parallel_ranks_give_the_tokens_of_one(three_layers):
    """Four ranks on an uneven split: stage 0 is ranks 0-1 (each its half of layer 0's heads),
    stage 1 ranks 2-3 (layers 1 and 2)."""
    model_dir, hf = three_layers
    single = engine_workload(str(model_dir), 1, logits=False)
    both = engine_workload(str(model_dir), 2, logits=False, pipeline_parallel_size=2)
    _assert_same(both, single)
    assert single["chunked"] == [hf_greedy(hf, p, 6) for p in single["prompts"]]
    assert worker_pids(os.getpid()) == []


@pytest.mark.parametrize(
    ("arch", "stages", "message"),
    (
        ("LlamaForCausalLM", 3, "more stages than the model's 2 decoder layers"),
        ("Gemma2ForCausalLM", 2, "Gemma2ForCausalLM is not split into stages yet"),
    ),
)
def test_what_cannot_be_staged_is_refused_before_any_worker_starts(arch, stages, message):
    model_dir, _ = engine_checkpoint(arch)
    with pytest.raises(ConfigError, match="pipeline_parallel_size") as caught:
        make_engine(model_dir, pipeline_parallel_size=stages)
    assert message in str(caught.value)
    assert worker_pids(os.getpid()) == []
