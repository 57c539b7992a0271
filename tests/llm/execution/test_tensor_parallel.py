"""Tensor parallelism on CPU with gloo, two ranks (issue 26, the sharding): on Llama, Mistral,
Qwen2 (qkv bias) and Qwen3 (q/k norms) shapes, and a Llama with one KV head (replicated on both
ranks), every rank of TP=2 gives the tokens of TP=1 and of transformers, with chunked prefill,
prefix-cache hits, preemption by recompute and swap and seeded sampling with n > 1; float32
logits within 1e-5 of TP=1.

Each rank runs the same engine steps on its shard (the scheduler is deterministic); the executor
in which rank 0 alone schedules and broadcasts is not built yet."""

from __future__ import annotations

import os

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.execution import workers
from backend_lib.llm.serving.engine_loop import EngineLoop
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt
from tests.llm.tensor_parallel_helpers import (
    engine_workload,
    engine_workloads,
    run_on_ranks,
    worker_pids,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """A tiny Llama with a single KV head: fewer KV heads than ranks."""
    from tests.llm.engine_helpers import _save_tokenizer
    from tooling.checkpoints import build_checkpoint

    out = tmp_path_factory.mktemp("one-kv-head")
    model = build_checkpoint("LlamaForCausalLM", out, num_key_value_heads=1)
    _save_tokenizer(out)
    return out, model


CASES = (*ARCHITECTURES, "one-kv-head")


@pytest.fixture(scope="module")
def checkpoints(one_kv_head):
    return {
        arch: one_kv_head if arch == "one-kv-head" else engine_checkpoint(arch) for arch in CASES
    }


@pytest.fixture(scope="module")
def unshardable(tmp_path_factory):
    """Checkpoints tensor parallelism refuses: three heads, a family not sharded yet; and a
    Llama asked for LoRA."""
    from tests.llm.engine_helpers import _save_tokenizer
    from tooling.checkpoints import build_checkpoint

    odd = tmp_path_factory.mktemp("three-heads")
    build_checkpoint(
        "LlamaForCausalLM", odd, hidden_size=48, num_attention_heads=3, num_key_value_heads=3
    )
    _save_tokenizer(odd)
    gemma, llama = (engine_checkpoint(a)[0] for a in ("Gemma2ForCausalLM", "LlamaForCausalLM"))
    return str(odd), str(gemma), str(llama)


@pytest.fixture(scope="module")
def two_ranks(checkpoints, unshardable):
    """On each of two ranks (one process start for all): every case's workload, and the
    refusals' messages."""
    dirs = [str(checkpoints[arch][0]) for arch in CASES]
    by_rank = run_on_ranks(rank_session, 2, dirs, *unshardable)
    return {
        "workloads": {arch: [r[0][i] for r in by_rank] for i, arch in enumerate(CASES)},
        "refusals": by_rank[0][1],
    }


def rank_session(dirs: list[str], odd: str, gemma: str, llama: str):
    refusals = (_refusal(odd), _refusal(gemma), _refusal(llama, enable_lora=True))
    return engine_workloads(dirs, 2), refusals


@pytest.mark.parametrize("arch", CASES)
def test_two_ranks_give_the_tokens_of_one(arch, checkpoints, two_ranks):
    model_dir, hf = checkpoints[arch]
    single = engine_workload(str(model_dir), 1)
    ranks = two_ranks["workloads"][arch]
    for rank, result in enumerate(ranks):
        for key in ("chunked", "prefix", "sampled", "recompute", "swap"):
            assert result[key] == single[key], (arch, rank, key)
        # The row-parallel sums add in another order: float32 rounding, on the logits' scale.
        scale = max(1.0, single["logits"].abs().max().item())
        assert (result["logits"] - single["logits"]).abs().max().item() <= 1e-5 * scale, arch
    assert ranks[0]["prefix_cached_tokens"] >= 16
    assert ranks[0]["recompute_preemptions"] > 0 and ranks[0]["swap_preemptions"] > 0
    expected = [hf_greedy(hf, p, 6) for p in single["prompts"]]
    assert single["chunked"] == expected


def test_rank_zero_drives_a_worker_process_and_leaves_none(checkpoints):
    """The engine of this process is rank 0: it starts rank 1 as a worker process, which
    replays its steps; same tokens as one rank (structured outputs too: only rank 0 schedules,
    so a grammar compiled in the background cannot put the ranks out of step); closing the
    engine ends the worker."""
    model_dir, _ = checkpoints["Qwen2ForCausalLM"]
    single = engine_workload(str(model_dir), 1, logits=False)
    driven = engine_workload(str(model_dir), 2, logits=False)
    for key in ("chunked", "prefix", "sampled", "structured", "recompute", "swap"):
        assert driven[key] == single[key], key
    assert all(
        text and set(text) <= set("abcdefghijklmnopqrstuvwxyz ") for text in driven["structured"]
    )
    assert driven["swap_preemptions"] > 0
    assert worker_pids(os.getpid()) == []


def test_a_killed_worker_fails_its_requests_naming_the_rank():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, tensor_parallel_size=2)
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = loop.submit("doomed", None, greedy(100), prompt_token_ids=random_prompt(9, 3))
        first = next(iter(stream))
        assert first.error is None
        (worker,) = engine.runner.workers.procs
        worker.kill()
        final = list(stream)[-1]
        assert final.finished and final.error and "tensor-parallel rank 1" in final.error
        # Later requests fail the same way, at once: no hang.
        again = list(loop.submit("later", None, greedy(3), prompt_token_ids=random_prompt(5, 4)))[
            -1
        ]
        assert again.error and "tensor-parallel rank 1" in again.error
    finally:
        loop.stop(timeout=60)
        engine.close()
    assert worker_pids(os.getpid()) == []


def test_a_worker_that_fails_to_start_fails_the_load_with_its_error(monkeypatch):
    monkeypatch.setattr(workers, "WORKER_MODULE", "tests.llm.failing_worker")
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    with pytest.raises(
        workers.WorkerDied,
        match=r"rank 1 \(pid \d+\) exited with code 1:\s+RuntimeError: out of memory",
    ):
        make_engine(model_dir, tensor_parallel_size=2)
    assert worker_pids(os.getpid()) == []
    assert not workers.driving()


def _refusal(model_dir: str, **overrides) -> str:
    try:
        make_engine(model_dir, tensor_parallel_size=2, **overrides)
    except ConfigError as e:
        return str(e)
    return "loaded"


def test_what_cannot_be_sharded_is_refused_naming_the_field(two_ranks):
    odd_msg, gemma_msg, lora_msg = two_ranks["refusals"]
    assert "tensor_parallel_size" in odd_msg and "3 attention heads" in odd_msg
    assert "tensor_parallel_size" in gemma_msg and "Gemma2ForCausalLM is not sharded" in gemma_msg
    assert "enable_lora" in lora_msg


def test_a_leader_serves_with_a_worker_node_started_apart(tmp_path):
    """nnodes 2: the engine (node 0, rank 0) waits for rank 1, run by the worker-node entry point
    started separately with the environment a LeaderWorkerSet worker pod gets (MASTER_ADDR,
    MASTER_PORT, NODE_RANK) on the same config.pbtxt; same tokens as one rank; closing the
    leader ends the worker node cleanly."""
    import subprocess
    import sys

    from backend_lib.config import from_parameters
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.engine.llm_engine import LLMEngine
    from tooling.repository import ModelSpec, write_model
    from tooling.tritonserver import free_port

    model_dir, _ = engine_checkpoint("Qwen3ForCausalLM")
    port = free_port()
    parameters = {
        "model": str(model_dir),
        "dtype": "float32",
        "kernel_backend": "torch",
        "num_blocks": "64",
        "block_size": "8",
        "max_model_len": "128",
        "tensor_parallel_size": "2",
        "nnodes": "2",
        "master_port": str(port),
    }
    write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), tmp_path)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1"}
    node = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "backend_lib.llm.execution.worker_node",
            "--model-dir",
            str(tmp_path / "llm"),
        ],
        env=env,
    )
    try:
        config = from_parameters(LLMConfig, parameters)
        leader = LLMEngine.from_config(config, tmp_path / "llm", torch.device("cpu"))
        prompts = [random_prompt(n, 40 + n) for n in (21, 6)]
        expected = [
            o.outputs[0].token_ids for o in make_engine(model_dir).generate(prompts, greedy(7))
        ]
        assert [o.outputs[0].token_ids for o in leader.generate(prompts, greedy(7))] == expected
        leader.close()
        assert node.wait(timeout=60) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
