"""Tensor parallelism: the engine at `tensor_parallel_size` 2 against 1 on the engine benchmark's
workload and random Llama (tooling.checkpoints FULL; QUICK under --quick), float32, in one process.

TP=2 makes the benchmark's engine rank 0 of a 2-rank torch.distributed group (gloo on CPU, NCCL
on CUDA): it starts rank 1 as a worker process, broadcasts each step's host data to it, and both
ranks run the sharded forward (column-parallel q/k/v and gate/up, row-parallel o and down with
one all-reduce each, the vocabulary-parallel embedding with one more, the lm_head's logits
all-gathered). On CPU the backend gives each rank its share of the cores (`cores // 2` threads;
the worker pinned to its own). The systems:

- tp1: one engine on one rank's share of the threads (1 on 2 cores: the suite's `--threads 1`,
  as every other benchmark; the headline's baseline);
- tp1_all_cores: one engine on every core the two ranks share (2 x the per-rank threads). On a
  shared 2-core machine its OpenMP threads stall whenever anything else takes a core (as
  bench/__main__.py says): measured 91.6 s against 18.1 s at one thread under a load average of
  ~9, so it is reported, not the baseline;
- tp2: rank 0 on its share here, rank 1 on its own in the worker.

Each system is one engine kept for the run (one TP=2 engine per process: its worker starts once,
~5-10 s, not timed), prefix caching off so that no repeat reuses an earlier one's KV blocks. The
greedy tokens of TP=2 are checked against TP=1 on the whole workload before timing (float32:
identical, or agreement reported where they part at exact ties), then the systems run
interleaved `--repeats` times in rotating order; figures are useful output tokens per second and
the ratio of medians `engine_tp2_vs_tp1` (TP=2 on two cores, one each, vs TP=1 on one). No
target: on a 2-core CPU the two ranks take every core, so anything else running (the machine is
shared) stalls one rank and with it the other at the next collective; every layer adds two
all-reduces and each step a broadcast, and the engine's Python per step (scheduling, input
preparation, sampling: rank 0 only) is not split at all.

One more TP=2 run, untimed as a figure, times rank 0's collectives (TensorParallel.all_reduce and
gather_columns, WorkerGroup.send wrapped with timers in this process only) and the bytes each
step's broadcast pickles: their share of the run's wall time says where TP=2's time goes. Rank
0's all-reduce time includes waiting for rank 1 to reach the same collective.

On CUDA (--device cuda) TP=2 needs 2 GPUs (NCCL; bfloat16 by default, tokens' agreement reported);
with fewer the TP=2 figure is skipped and the result says why. Pipeline parallelism is not built
yet: no PP figure.

--threads is not used: the thread counts follow the backend's share per rank (above); the load
averages before and after are recorded (other processes on the cores slow the 2-core systems
most).

    python -m bench.parallel [--quick] [--repeats 3] [--out bench/results/parallel.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from bench import cli, plots
from bench.llm import Workload, agreement, greedy, make_workload, new_engine, workload_record
from bench.skeleton import Benchmark
from bench.timing import spread, time_interleaved, timed
from tooling.checkpoints import FULL, GPU, QUICK, build_random_llama

NAME = "parallel"
HEADING = "Tensor parallelism: TP=2 vs TP=1"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
KEY = "engine_tp2_vs_tp1"
TP = 2
PP_STATUS = "pipeline parallelism is not built yet (LLMConfig has no pipeline_parallel_size)"
NO_TARGET = (
    "no target: on 2 cores the two ranks get one core each and take every core, so anything else "
    "on the machine stalls one rank and the other waits at the next collective; every layer adds "
    "two all-reduces (after o_proj and down_proj), the embedding one more, the logits an "
    "all-gather, each step a pickled broadcast of its inputs, and rank 0's Python per step "
    "(schedule, inputs, sampling) is not split"
)


class Engine:
    """One engine kept for the whole run (prefix caching off), its torch threads set before each
    run (rank 0's; the worker's are its own)."""

    def __init__(self, model_dir: Path, dtype: str, device, threads: int, tp: int):
        import torch

        self.threads, self.tp = threads, tp
        if threads:
            torch.set_num_threads(threads)
        self.engine = new_engine(
            model_dir,
            device,
            dtype,
            max_model_len=1024,
            max_num_seqs=64,
            enable_prefix_caching=False,
            tensor_parallel_size=tp,
        )

    def run(self, workload: Workload) -> tuple[list[list[int]], float]:
        import torch

        if self.threads:
            torch.set_num_threads(self.threads)
        params = [greedy(n) for n in workload.output_lens]
        outputs, seconds = timed(lambda: self.engine.generate(workload.prompts, params))()
        return [out.outputs[0].token_ids for out in outputs], seconds

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def collective_timers(device) -> Iterator[dict]:
    """Rank 0's seconds in each collective and the broadcast's pickled bytes, while inside."""
    import torch

    from backend_lib.llm.execution.tensor_parallel import TensorParallel
    from backend_lib.llm.execution.workers import WorkerGroup

    record: dict = {"seconds": defaultdict(float), "calls": defaultdict(int), "broadcast_bytes": []}
    sync = device.type == "cuda"
    originals = {
        (TensorParallel, "all_reduce"): TensorParallel.all_reduce,
        (TensorParallel, "gather_columns"): TensorParallel.gather_columns,
        (WorkerGroup, "send"): WorkerGroup.send,
    }

    def wrap(name: str, inner):
        def call(self, x):
            if name == "step_broadcast":
                record["broadcast_bytes"].append(len(pickle.dumps([x])))
            if sync:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            result = inner(self, x)
            if sync:
                torch.cuda.synchronize(device)
            record["seconds"][name] += time.perf_counter() - started
            record["calls"][name] += 1
            return result

        return call

    names = {"all_reduce": "all_reduce", "gather_columns": "all_gather", "send": "step_broadcast"}
    for (owner, attribute), inner in originals.items():
        setattr(owner, attribute, wrap(names[attribute], inner))
    try:
        yield record
    finally:
        for (owner, attribute), inner in originals.items():
            setattr(owner, attribute, inner)


def collectives(engine: Engine, workload: Workload, device) -> dict[str, object]:
    """One more TP=2 run with rank 0's collectives timed: seconds, calls, share of wall time,
    and the per-step broadcast (bytes pickled, seconds)."""
    with collective_timers(device) as record:
        _, wall = engine.run(workload)
    seconds, calls = dict(record["seconds"]), dict(record["calls"])
    sizes = record["broadcast_bytes"]
    steps = calls.get("step_broadcast", 0)
    total = sum(seconds.values())
    return {
        "wall_seconds": wall,
        "seconds": seconds,
        "calls": calls,
        "share_of_wall": {name: s / wall for name, s in seconds.items()},
        "collective_share": total / wall,
        "steps": steps,
        "broadcast": {
            "bytes_per_step": {
                "mean": statistics.mean(sizes) if sizes else 0.0,
                "max": max(sizes, default=0),
            },
            "bytes_total": sum(sizes),
            "seconds_per_step": seconds.get("step_broadcast", 0.0) / max(steps, 1),
        },
        "all_reduce_per_step": calls.get("all_reduce", 0) / max(steps, 1),
    }


def skip_reason(device) -> str | None:
    """Why TP=2 cannot run here (None: it can)."""
    import torch

    if device.type == "cuda" and torch.cuda.device_count() < TP:
        return (
            f"TP={TP} on CUDA needs {TP} GPUs (one rank each, NCCL); this machine has "
            f"{torch.cuda.device_count()}"
        )
    return None


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    import torch

    from backend_lib.device import resolve_dtype
    from backend_lib.llm.execution.workers import threads_per_rank

    device = cli.default_device(args.device)
    dtype_name = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    sizes = {"quick": QUICK, "cuda": GPU, "cpu": FULL}[cli.mode(args.quick, device)]
    workload = make_workload(sizes, args.seed)
    num_params = build_random_llama(sizes, model_dir, args.seed)
    cpu = device.type == "cpu"
    rank_threads = threads_per_rank(TP) if cpu else 0
    threads = {"tp1": rank_threads, "tp1_all_cores": TP * rank_threads, "tp2": rank_threads}
    if not cpu:
        threads = {"tp1": 0, "tp2": 0}
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {dtype_name} on {device}; "
        f"{sizes.requests} requests, {sum(map(len, workload.prompts))} prompt tokens, "
        f"{workload.num_output_tokens} output tokens; torch threads {threads}",
        flush=True,
    )
    common = {
        "device": str(device),
        "dtype": dtype_name,
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": workload_record(workload, args.seed),
        "repeats": args.repeats,
        "pipeline_parallel": {"measured": False, "reason": PP_STATUS},
        "target": NO_TARGET,
    }
    engines = {
        name: Engine(model_dir, dtype_name, device, t, tp=1)
        for name, t in threads.items()
        if name != "tp2"
    }
    reason = skip_reason(device)
    if reason is not None:
        print(f"TP={TP} skipped: {reason}")
        outputs, seconds = engines["tp1"].run(workload)
        return {
            **common,
            "tensor_parallel": {"measured": False, "reason": reason},
            "seconds": {"tp1": [seconds]},
            "output_tokens_per_second": {"tp1": workload.num_output_tokens / seconds},
            "summary": {},
            "missing": {KEY: reason},
        }
    load_before = os.getloadavg()
    started = time.perf_counter()
    engines["tp2"] = Engine(model_dir, dtype_name, device, threads["tp2"], tp=TP)
    start_seconds = time.perf_counter() - started
    try:
        return {
            **common,
            **measure(args, engines, workload, device, dtype_name),
            "tensor_parallel": {
                "measured": True,
                "size": TP,
                "backend": "nccl" if device.type == "cuda" else "gloo",
                "engine_start_seconds": start_seconds,
            },
            "settings": {
                "engine": asdict(engines["tp2"].engine.config),
                "torch_threads": threads,
                "worker_threads": rank_threads,
                "load_average_before": load_before,
                "cpu_count": os.cpu_count(),
                "load_average_after": os.getloadavg(),
                "rank0_affinity": sorted(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else None,
            },
        }
    finally:
        engines["tp2"].close()
        torch.set_num_threads(threads["tp1"] or torch.get_num_threads())


def measure(args, engines: dict[str, Engine], workload: Workload, device, dtype_name) -> dict:
    """Check TP=2's greedy tokens against TP=1 (this warms every engine up), time the systems
    interleaved, then time TP=2's collectives in one more run."""
    reference, _ = engines["tp1"].run(workload)
    checked = {name: e.run(workload)[0] for name, e in engines.items() if name != "tp1"}
    scores = {name: agreement(reference, out) for name, out in checked.items()}
    identical = all(s["requests"] == 1.0 for s in scores.values())
    print(f"greedy agreement with tp1 on the whole workload: {scores}", flush=True)
    fidelity = {
        "reference": "tp1",
        "exact_expected": dtype_name == "float32",
        "agreement": scores,
        "identical": identical,
        # Reported, not required: float32 sums in another order may part at an exact tie.
        "passed": True,
    }
    systems = {name: (lambda e=e: e.run(workload)) for name, e in engines.items()}
    seconds, outputs = time_interleaved(systems, args.repeats)
    split = collectives(engines["tp2"], workload, device)
    print(
        f"TP=2 collectives on rank 0: {split['collective_share']:.3f} of {split['wall_seconds']:.2f}"
        f" s ({ {k: round(v, 3) for k, v in split['seconds'].items()} }); broadcast "
        f"{split['broadcast']['bytes_per_step']['mean']:.0f} B and "
        f"{split['broadcast']['seconds_per_step'] * 1e3:.3f} ms per step",
        flush=True,
    )
    tokens = workload.num_output_tokens
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = median["tp1"] / median["tp2"]
    return {
        "fidelity": fidelity,
        "agreement_after_timing": {
            name: agreement(outputs["tp1"], out) for name, out in outputs.items() if name != "tp1"
        },
        "seconds": seconds,
        "output_tokens_per_second": {name: tokens / t for name, t in median.items()},
        "output_tokens_per_second_spread": {
            name: spread([tokens / t for t in s]) for name, s in seconds.items()
        },
        "ratio_vs_tp1": {name: median["tp1"] / t for name, t in median.items()},
        "collectives": split,
        "summary": {KEY: ratio},
    }


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work = result["model"], result["workload"]
    lines = [
        f"Random-weight Llama, {model['parameters'] / 1e6:.1f}M parameters ({model['layers']} "
        f"layers, hidden {model['hidden']}, GQA {model['heads']}/{model['kv_heads']}), "
        f"{result['dtype']} on {result['device']}; {work['requests']} requests, "
        f"{work['prompt_tokens']} prompt tokens, {work['output_tokens']} output tokens (greedy, "
        "ignore_eos). Pipeline parallelism: not measured, "
        + result["pipeline_parallel"]["reason"]
        + ".",
        "",
    ]
    tp = result["tensor_parallel"]
    if not tp["measured"]:
        return [
            *lines,
            "| system | output tokens/s |",
            "|---|---|",
            f"| TP=1 | {result['output_tokens_per_second']['tp1']:.1f} |",
            "",
            f"- `{KEY}`: not measured, {tp['reason']}.",
        ]
    threads = result["settings"]["torch_threads"]
    if result["device"].startswith("cuda"):
        threads = {"tp1": "GPU", "tp2": "GPU"}
    names = {
        "tp1": f"TP=1, {threads['tp1']} thread(s) (one rank's share)",
        "tp1_all_cores": f"TP=1 on both ranks' cores, {threads.get('tp1_all_cores')} thread(s)",
        "tp2": f"TP=2 ({tp['backend']}), {threads['tp2']} thread(s) per rank",
    }
    lines += [
        f"Greedy tokens of every system vs TP=1 before timing: {result['fidelity']['agreement']}"
        f" ({'identical' if result['fidelity']['identical'] else 'NOT identical: reported'}).",
        "",
        "| system | output tokens/s (median) | min | max | vs TP=1 |",
        "|---|---|---|---|---|",
    ]
    for name, rate in result["output_tokens_per_second_spread"].items():
        lines.append(
            f"| {names.get(name, name)} | {rate['median']:.1f} | {rate['min']:.1f} | "
            f"{rate['max']:.1f} | {result['ratio_vs_tp1'][name]:.2f}x |"
        )
    c = result["collectives"]
    b = c["broadcast"]
    parts = ", ".join(
        f"{name} {seconds:.2f} s ({c['calls'][name]} calls)"
        for name, seconds in c["seconds"].items()
    )
    lines += [
        "",
        f"- TP=2 (a core each) / TP=1 (one core): **{result['summary'][KEY]:.2f}x** ({result['target']}).",
        f"- Rank 0's collectives, one more TP=2 run of {c['wall_seconds']:.2f} s: "
        f"**{c['collective_share']:.3f}** of its wall time ({parts}; all-reduce time includes "
        f"waiting for rank 1). Per step ({c['steps']} steps): {c['all_reduce_per_step']:.0f} "
        f"all-reduces, one broadcast of {b['bytes_per_step']['mean']:.0f} B pickled on average "
        f"(max {b['bytes_per_step']['max']}) taking {b['seconds_per_step'] * 1e3:.3f} ms.",
        f"- The TP=2 engine's start (worker process, rendezvous, its shard loaded): "
        f"{tp['engine_start_seconds']:.1f} s, not timed. Load average (1 min) before and after: "
        f"{result['settings']['load_average_before'][0]:.1f}, "
        f"{result['settings']['load_average_after'][0]:.1f}.",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Bar chart of output tokens/s per system."""
    rates = result.get("output_tokens_per_second_spread")
    if not rates:
        return []
    names = list(rates)
    medians, errors = plots.medians_and_errors(rates.values())
    fig, ax = plots.pyplot().subplots(figsize=(6, 3.5))
    ax.bar(names, medians, yerr=errors, color=["tab:gray", "tab:olive", "tab:green"][: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Tensor parallelism ({result['workload']['requests']} requests, {result['dtype']}, "
        f"{result['device']})"
    )
    for x, y in enumerate(medians):
        ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom")
    return [plots.save(fig, out_dir / "parallel_throughput.png", dpi=110)]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
