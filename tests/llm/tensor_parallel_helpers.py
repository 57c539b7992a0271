"""Running a function on every rank of a local torch.distributed group (gloo, one process per
rank, one thread each), for the tensor-parallel tests; each rank runs the same engine steps."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend_lib.llm.execution.workers import WORKER_MODULE
from tooling.tritonserver import free_port

RANK_TIMEOUT_S = 300


def _rank_main(fn, args, rank: int, size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        # Pickled here: the queue's own pickler would share tensors through file descriptors,
        # which die with this process.
        results.put((rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], size: int, *args: Any) -> list[Any]:
    """`fn(*args)` on `size` fresh processes joined in one gloo group; their results by rank.
    A rank that fails (or a hang past RANK_TIMEOUT_S) fails the call; no process outlives it."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(fn, args, rank, size, port, results))
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    try:
        out: dict[int, Any] = {}
        for _ in procs:
            rank, value, error = results.get(timeout=RANK_TIMEOUT_S)
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = pickle.loads(value)
        return [out[rank] for rank in range(size)]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def variant_checkpoint(out: Path, arch: str = "LlamaForCausalLM", **overrides: Any):
    """(dir, HF model) of a tiny `arch` checkpoint (tooling.checkpoints) with config `overrides`
    (e.g. one KV head, three layers) and the engine tests' tokenizer, written to `out`."""
    from tests.llm.engine_helpers import _save_tokenizer
    from tooling.checkpoints import build_checkpoint

    model = build_checkpoint(arch, out, **overrides)
    _save_tokenizer(out)
    return out, model


def worker_pids(parent: int | None = None) -> list[int]:
    """Live tensor-parallel worker processes: children of `parent`, or all of them (None)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
            cmdline = (status.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ours = parent is None or int(fields.get("PPid", "0")) == parent
        if ours and WORKER_MODULE.encode() in cmdline:
            pids.append(int(status.parent.name))
    return pids


def engine_workloads(model_dirs: list[str], tensor_parallel_size: int) -> list[dict[str, Any]]:
    """`engine_workload` of each checkpoint in turn (one process start for all of them), without
    structured outputs: where every rank runs its own engine, each compiles grammars in the
    background on its own clock, and the ranks' schedules (so their collectives) would part."""
    return [engine_workload(d, tensor_parallel_size, structured=False) for d in model_dirs]


def engine_workload(
    model_dir: str,
    tensor_parallel_size: int,
    logits: bool = True,
    structured: bool = True,
    pipeline_parallel_size: int = 1,
    preemption: bool = True,
) -> dict[str, Any]:
    """What the tensor-parallel tests compare between ranks and with one rank: greedy tokens with
    chunked prefill and a prefix-cache hit, seeded samples with n > 1, structured outputs (a
    regex; compiled off the engine's path), greedy tokens under
    preemption by recompute and by swap, the top prompt logprobs of one prompt through the engine
    (float32, so a rank 0 that drives workers is checked to the logits' precision too), and
    (`logits`) float32 logits of one prompt, run on the runner's model directly: only where every
    rank runs the same engine, not on a rank 0 that drives workers (they would miss that
    forward's collectives)."""
    import torch

    from backend_lib.llm.core.sampling_params import SamplingParams
    from tests.llm.engine_helpers import greedy, make_engine, output_ids, random_prompt
    from tests.llm.execution.logits_helpers import all_logits

    tp = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    # One tensor-parallel engine per process at a time: each is closed before the next.
    engine = make_engine(model_dir, max_num_batched_tokens=16, **tp)
    prompts = [random_prompt(n, 30 + n) for n in (27, 12, 5)]
    shared = random_prompt(24, 99)
    out: dict[str, Any] = {"prompts": prompts, "chunked": output_ids(engine, prompts, greedy(6))}
    first, second = (
        engine.generate([shared + random_prompt(3, seed)], greedy(5))[0] for seed in (1, 2)
    )
    out["prefix"] = [first.outputs[0].token_ids, second.outputs[0].token_ids]
    out["prefix_cached_tokens"] = second.num_cached_tokens
    sampled = engine.generate(
        prompts[:2], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6)
    )
    out["sampled"] = [[c.token_ids for c in o.outputs] for o in sampled]
    if structured:
        constrained = SamplingParams(
            temperature=0.0, max_tokens=6, structured_outputs={"regex": "[a-z ]+"}
        )
        out["structured"] = [o.outputs[0].text for o in engine.generate(prompts, constrained)]
    scored = engine.generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=8)
    )[0]
    out["prompt_logprobs"] = [
        None if entry is None else {t: lp.logprob for t, lp in entry.items()}
        for entry in scored.prompt_logprobs
    ]
    if logits:
        out["logits"] = all_logits(engine.runner, prompts[0])
        assert isinstance(out["logits"], torch.Tensor)
    engine.close()
    for mode in ("recompute", "swap") if preemption else ():
        small = make_engine(
            model_dir,
            num_blocks=10,
            max_model_len=40,
            max_num_batched_tokens=16,
            preemption_mode=mode,
            swap_space=0.001,
            **tp,
        )
        many = [random_prompt(n, 10 + n) for n in (19, 13, 22, 7, 16)]
        out[mode] = output_ids(small, many, greedy(10))
        out[f"{mode}_preemptions"] = small.stats().counters.num_preemptions
        small.close()
    return out
