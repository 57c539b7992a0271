"""Tensor and pipeline parallelism: the engine at `tensor_parallel_size` 2 and at
`pipeline_parallel_size` 2 against one rank, on the engine benchmark's workload and random Llama
(tooling.checkpoints FULL; QUICK under --quick), float32, in one process.

TP=2 makes the benchmark's engine rank 0 of a 2-rank torch.distributed group (gloo on CPU, NCCL
on CUDA): it starts rank 1 as a worker process, broadcasts each step's host data to it, and both
ranks run the sharded forward (column-parallel q/k/v and gate/up, row-parallel o and down with
one all-reduce each, the vocabulary-parallel embedding with one more, the lm_head's logits
all-gathered). PP=2 (`pipeline_parallel_size` 2, `tensor_parallel_size` 1) starts its worker the
same way, but splits the decoder layers instead of each layer: rank 0 is stage 0 (embedding, the
first half of the layers, lm_head, sampling), the worker stage 1 (the other half and the final
norm); each step stage 0 sends hidden and residual [2, T, hidden] to stage 1 (dist.send) and
waits for the scored rows to come back. On CPU the backend gives each rank its share of the cores
(`cores // 2` threads; the worker pinned to its own). The systems:

- tp1: one engine on one rank's share of the threads (1 on 2 cores: the suite's `--threads 1`,
  as every other benchmark; the baseline of both ratios);
- tp1_all_cores: one engine on every core the two ranks share (2 x the per-rank threads). On a
  shared 2-core machine its OpenMP threads stall whenever anything else takes a core (as
  bench/__main__.py says): measured 91.6 s against 18.1 s at one thread under a load average of
  ~9, so it is reported, not the baseline;
- tp2: rank 0 on its share here, rank 1 on its own in the worker;
- pp2: stage 0 on its share here, stage 1 on its own in the worker (the same threads as tp2).

Each system is one engine kept for its timing (prefix caching off, so that no repeat reuses an
earlier one's KV blocks). Only one multi-rank engine may exist in a process (torch.distributed
has one default group: WorkerGroup refuses a second), so the multi-rank systems run in turn, in
two rotations: tp1 and tp1_all_cores are built once and kept for the whole run; the TP=2 engine
is built (its worker starts, ~5-10 s, not timed), its greedy tokens checked against tp1's on the
whole workload (float32: identical, or agreement reported where they part at exact ties), then
tp1, tp1_all_cores and tp2 run interleaved `--repeats` times in rotating order, and the engine is
closed; then the same for the PP=2 engine, interleaved with tp1 alone. Figures are useful output
tokens per second, and each ratio of medians is taken against the tp1 runs of its own rotation:
`engine_tp2_vs_tp1` (TP=2 on two cores, one each, vs TP=1 on one) and `engine_pp2_vs_tp1`
(PP=2, the same cores). No target for either: on a 2-core CPU the two ranks take every core, so
anything else running (the machine is shared) stalls one rank and with it the other at the next
collective or message; TP=2 adds two all-reduces per layer and a broadcast per step, and the
engine's Python per step (scheduling, input preparation, sampling: rank 0 only) is not split.

PP=2 is not expected to be faster than TP=1 here, and is not: there is no micro-batch overlap,
so each step's two stages run one after the other (stage 1 idle while stage 0 embeds and runs its
layers, stage 0 idle while stage 1 runs its own), which costs the whole forward in series as on
one rank, plus a broadcast of the step and two point-to-point messages (activations out, scored
rows back) per step. What PP buys is memory: each rank holds half the layers and their KV cache.

One more run of each multi-rank engine, untimed as a figure, times rank 0's communication with
timers wrapped around these methods in this process only: for TP=2, TensorParallel.all_reduce and
gather_columns and WorkerGroup.send (the step's broadcast; the bytes it pickles recorded); for
PP=2, PipelineStage.send_forward and recv_output (rank 0 is stage 0) and the broadcast. Their
share of the run's wall time says where the time goes. Rank 0's all-reduce time includes waiting
for rank 1 to reach the same collective, and stage 0's recv_output time is mostly waiting for
stage 1 to run its layers: the "p2p" share is stage 1's part of the step, not the wire.

On CUDA (--device cuda) TP=2 and PP=2 each need 2 GPUs (NCCL, one rank each; bfloat16 by
default, tokens' agreement reported); with fewer both figures are skipped and the result says why.

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
HEADING = "Tensor and pipeline parallelism: TP=2 and PP=2 vs TP=1"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
KEY = "engine_tp2_vs_tp1"
PP_KEY = "engine_pp2_vs_tp1"
TP = 2
PP = 2
WORLD = 2
"""Ranks of each multi-rank system (TP=2 x PP=1, TP=1 x PP=2)."""
MULTI_RANK = {"tp2": {"tp": TP, "pp": 1}, "pp2": {"tp": 1, "pp": PP}}
"""The multi-rank systems, built, checked and timed in turn (one per process at a time)."""
PP_STATUS = (
    "no micro-batch overlap: each step runs stage 0 then stage 1 in series (the other idle), the "
    "whole forward as on one rank plus a broadcast and two p2p messages (activations out, scored "
    "rows back); only the memory per rank halves"
)
NO_TARGET = (
    "no target: on 2 cores the two ranks get one core each and take every core, so anything else "
    "on the machine stalls one rank and the other waits at the next collective or message; under "
    "TP every layer adds two all-reduces (after o_proj and down_proj), the embedding one more, "
    "the logits an all-gather; under PP the stages run in series (no micro-batch overlap) with two "
    "p2p messages a step; each step adds a pickled broadcast of its inputs, and rank 0's Python "
    "per step (schedule, inputs, sampling) is not split"
)


class Engine:
    """One engine kept for its timing (prefix caching off), its torch threads set before each
    run (rank 0's; the worker's are its own)."""

    def __init__(self, model_dir: Path, dtype: str, device, threads: int, tp: int, pp: int = 1):
        import torch

        self.threads, self.tp, self.pp = threads, tp, pp
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
            pipeline_parallel_size=pp,
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


def _timed_methods(pipeline: bool) -> dict[tuple[type, str], str]:
    """(class, method) -> the name its seconds are recorded under: TP=2's collectives, or PP=2's
    stage-0 messages; the step's broadcast in both."""
    from backend_lib.llm.execution.pipeline_parallel import PipelineStage
    from backend_lib.llm.execution.tensor_parallel import TensorParallel
    from backend_lib.llm.execution.workers import WorkerGroup

    if pipeline:
        methods = {
            (PipelineStage, "send_forward"): "send_forward",
            (PipelineStage, "recv_output"): "recv_output",
        }
    else:
        methods = {
            (TensorParallel, "all_reduce"): "all_reduce",
            (TensorParallel, "gather_columns"): "all_gather",
        }
    return {**methods, (WorkerGroup, "send"): "step_broadcast"}


@contextlib.contextmanager
def collective_timers(device, pipeline: bool = False, model=None) -> Iterator[dict]:
    """Rank 0's seconds in each collective (TP) or p2p message (PP, stage 0), the broadcast's
    pickled bytes and the activations' bytes sent forward, while inside. `model` (rank 0's):
    its forward's calls, which hold the row-parallel all-reduce bound at load, are bound again
    on entry (to the timed methods) and on exit (to the plain ones)."""
    import torch

    def rebind() -> None:
        if model is not None and hasattr(model, "bind_forward"):
            model.bind_forward()

    record: dict = {
        "seconds": defaultdict(float),
        "calls": defaultdict(int),
        "broadcast_bytes": [],
        "forward_bytes": [],
    }
    sync = device.type == "cuda"
    methods = _timed_methods(pipeline)
    originals = {key: getattr(*key) for key in methods}

    def wrap(name: str, inner):
        def call(self, *args):
            if name == "step_broadcast":
                record["broadcast_bytes"].append(len(pickle.dumps(list(args))))
            elif name == "send_forward":
                record["forward_bytes"].append(sum(a.numel() * a.element_size() for a in args))
            if sync:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            result = inner(self, *args)
            if sync:
                torch.cuda.synchronize(device)
            record["seconds"][name] += time.perf_counter() - started
            record["calls"][name] += 1
            return result

        return call

    for (owner, attribute), inner in originals.items():
        setattr(owner, attribute, wrap(methods[(owner, attribute)], inner))
    try:
        rebind()
        yield record
    finally:
        for (owner, attribute), inner in originals.items():
            setattr(owner, attribute, inner)
        rebind()


def _split(record: dict, wall: float) -> dict[str, object]:
    """The timed run's seconds, calls, shares of wall time and per-step broadcast."""
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
    }


def collectives(engine: Engine, workload: Workload, device) -> dict[str, object]:
    """One more TP=2 run with rank 0's collectives timed: seconds, calls, share of wall time,
    and the per-step broadcast (bytes pickled, seconds)."""
    with collective_timers(device, model=engine.engine.runner.model) as record:
        _, wall = engine.run(workload)
    split = _split(record, wall)
    split["all_reduce_per_step"] = split["calls"].get("all_reduce", 0) / max(split["steps"], 1)
    return split


def p2p(engine: Engine, workload: Workload, device) -> dict[str, object]:
    """One more PP=2 run with stage 0's messages timed (send_forward: the activations to stage 1;
    recv_output: waiting for stage 1's layers and its scored rows), as `collectives`; "p2p_share"
    is the two messages' share of wall time."""
    with collective_timers(device, True, engine.engine.runner.model) as record:
        _, wall = engine.run(workload)
    split = _split(record, wall)
    seconds, steps = split["seconds"], max(split["steps"], 1)
    sent = record["forward_bytes"]
    split["p2p_share"] = (seconds.get("send_forward", 0.0) + seconds.get("recv_output", 0.0)) / wall
    split["send_forward"] = {
        "bytes_per_step": statistics.mean(sent) if sent else 0.0,
        "bytes_total": sum(sent),
        "seconds_per_step": seconds.get("send_forward", 0.0) / steps,
    }
    split["recv_output_seconds_per_step"] = seconds.get("recv_output", 0.0) / steps
    return split


def skip_reason(device) -> str | None:
    """Why TP=2 and PP=2 cannot run here (None: they can)."""
    import torch

    if device.type == "cuda" and torch.cuda.device_count() < WORLD:
        return (
            f"TP={TP} and PP={PP} on CUDA need {WORLD} GPUs (one rank each, NCCL); this machine "
            f"has {torch.cuda.device_count()}"
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
    rank_threads = threads_per_rank(WORLD) if cpu else 0
    threads = {
        "tp1": rank_threads,
        "tp1_all_cores": WORLD * rank_threads,
        "tp2": rank_threads,
        "pp2": rank_threads,
    }
    if not cpu:
        threads = {"tp1": 0, "tp2": 0, "pp2": 0}
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
        "target": NO_TARGET,
    }
    engines = {
        name: Engine(model_dir, dtype_name, device, t, tp=1)
        for name, t in threads.items()
        if name not in MULTI_RANK
    }
    reason = skip_reason(device)
    if reason is not None:
        print(f"TP={TP} and PP={PP} skipped: {reason}")
        outputs, seconds = engines["tp1"].run(workload)
        return {
            **common,
            "tensor_parallel": {"measured": False, "reason": reason},
            "pipeline_parallel": {"measured": False, "reason": reason},
            "seconds": {"tp1": [seconds]},
            "output_tokens_per_second": {"tp1": workload.num_output_tokens / seconds},
            "summary": {},
            "missing": {KEY: reason, PP_KEY: reason},
        }
    load_before = os.getloadavg()
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        measured = measure(args, engines, workload, device, dtype_name, model_dir, threads)
    finally:
        torch.set_num_threads(threads["tp1"] or torch.get_num_threads())
    starts, configs = measured.pop("engine_start_seconds"), measured.pop("engine_configs")
    return {
        **common,
        **measured,
        "tensor_parallel": {
            "measured": True,
            "size": TP,
            "backend": backend,
            "engine_start_seconds": starts["tp2"],
        },
        "pipeline_parallel": {
            "measured": True,
            "size": PP,
            "tensor_parallel_size": 1,
            "backend": backend,
            "engine_start_seconds": starts["pp2"],
            "why_not_faster": PP_STATUS,
        },
        "settings": {
            "engine": configs["tp2"],
            "engine_pp2": configs["pp2"],
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


def measure(
    args, engines: dict[str, Engine], workload: Workload, device, dtype_name, model_dir, threads
) -> dict:
    """tp1's reference tokens (this warms the single-rank engines up), then each multi-rank
    system in turn: built, its greedy tokens checked against tp1's, timed interleaved with the
    single-rank engines (pp2 with tp1 alone), its communication timed in one more run, closed."""
    reference, _ = engines["tp1"].run(workload)
    checked = {name: e.run(workload)[0] for name, e in engines.items() if name != "tp1"}
    rotations: dict[str, dict] = {}
    starts, configs, splits, after = {}, {}, {}, {}
    for name, ranks in MULTI_RANK.items():
        started = time.perf_counter()
        engine = Engine(model_dir, dtype_name, device, threads[name], ranks["tp"], ranks["pp"])
        starts[name] = time.perf_counter() - started
        try:
            configs[name] = asdict(engine.engine.config)
            checked[name] = engine.run(workload)[0]
            print(f"{name} greedy agreement with tp1: {agreement(reference, checked[name])}")
            others = engines if name == "tp2" else {"tp1": engines["tp1"]}
            systems = {
                n: (lambda e=e: e.run(workload)) for n, e in {**others, name: engine}.items()
            }
            seconds, outputs = time_interleaved(systems, args.repeats)
            rotations[name] = {"systems": list(systems), "seconds": seconds}
            after.update(
                {n: agreement(outputs["tp1"], out) for n, out in outputs.items() if n != "tp1"}
            )
            splits[name] = (collectives if name == "tp2" else p2p)(engine, workload, device)
        finally:
            engine.close()
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
    c, p = splits["tp2"], splits["pp2"]
    print(
        f"TP=2 collectives on rank 0: {c['collective_share']:.3f} of {c['wall_seconds']:.2f}"
        f" s ({ {k: round(v, 3) for k, v in c['seconds'].items()} }); broadcast "
        f"{c['broadcast']['bytes_per_step']['mean']:.0f} B and "
        f"{c['broadcast']['seconds_per_step'] * 1e3:.3f} ms per step",
        flush=True,
    )
    print(
        f"PP=2 stage 0's p2p: {p['p2p_share']:.3f} of {p['wall_seconds']:.2f} s "
        f"({ {k: round(v, 3) for k, v in p['seconds'].items()} })",
        flush=True,
    )
    tokens = workload.num_output_tokens
    seconds: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, float] = {}
    for rotation in rotations.values():
        base = statistics.median(rotation["seconds"]["tp1"])
        medians = {n: statistics.median(s) for n, s in rotation["seconds"].items()}
        rotation["ratio_vs_tp1"] = {n: base / t for n, t in medians.items()}
        for n, s in rotation["seconds"].items():
            seconds[n] += s
            if n != "tp1":
                ratios[n] = base / medians[n]
    ratios["tp1"] = 1.0
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "fidelity": fidelity,
        "agreement_after_timing": after,
        "rotations": rotations,
        "seconds": dict(seconds),
        "output_tokens_per_second": {name: tokens / t for name, t in median.items()},
        "output_tokens_per_second_spread": {
            name: spread([tokens / t for t in s]) for name, s in seconds.items()
        },
        "ratio_vs_tp1": ratios,
        "collectives": c,
        "p2p": p,
        "summary": {KEY: ratios["tp2"], PP_KEY: ratios["pp2"]},
        "engine_start_seconds": starts,
        "engine_configs": configs,
    }


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work = result["model"], result["workload"]
    lines = [
        f"Random-weight Llama, {model['parameters'] / 1e6:.1f}M parameters ({model['layers']} "
        f"layers, hidden {model['hidden']}, GQA {model['heads']}/{model['kv_heads']}), "
        f"{result['dtype']} on {result['device']}; {work['requests']} requests, "
        f"{work['prompt_tokens']} prompt tokens, {work['output_tokens']} output tokens (greedy, "
        "ignore_eos).",
        "",
    ]
    tp, pp = result["tensor_parallel"], result["pipeline_parallel"]
    if not tp["measured"]:
        return [
            *lines,
            "| system | output tokens/s |",
            "|---|---|",
            f"| TP=1 | {result['output_tokens_per_second']['tp1']:.1f} |",
            "",
            f"- `{KEY}`: not measured, {tp['reason']}.",
            f"- `{PP_KEY}`: not measured, {pp['reason']}.",
        ]
    threads = result["settings"]["torch_threads"]
    if result["device"].startswith("cuda"):
        threads = {"tp1": "GPU", "tp2": "GPU", "pp2": "GPU"}
    names = {
        "tp1": f"TP=1, {threads['tp1']} thread(s) (one rank's share; both rotations)",
        "tp1_all_cores": f"TP=1 on both ranks' cores, {threads.get('tp1_all_cores')} thread(s)",
        "tp2": f"TP=2 ({tp['backend']}), {threads['tp2']} thread(s) per rank",
        "pp2": f"PP=2 ({pp['backend']}), {threads['pp2']} thread(s) per stage",
    }
    lines += [
        f"Greedy tokens of every system vs TP=1 before timing: {result['fidelity']['agreement']}"
        f" ({'identical' if result['fidelity']['identical'] else 'NOT identical: reported'}).",
        "TP=2 and PP=2 are timed in turn (one multi-rank engine per process), each interleaved "
        "with TP=1; `vs TP=1` is against the TP=1 runs of its own rotation.",
        "",
        "| system | output tokens/s (median) | min | max | vs TP=1 |",
        "|---|---|---|---|---|",
    ]
    for name, rate in result["output_tokens_per_second_spread"].items():
        lines.append(
            f"| {names.get(name, name)} | {rate['median']:.1f} | {rate['min']:.1f} | "
            f"{rate['max']:.1f} | {result['ratio_vs_tp1'][name]:.2f}x |"
        )
    c, p = result["collectives"], result["p2p"]
    b = c["broadcast"]

    def parts(split: dict) -> str:
        return ", ".join(
            f"{name} {seconds:.2f} s ({split['calls'][name]} calls)"
            for name, seconds in split["seconds"].items()
        )

    f = p["send_forward"]
    lines += [
        "",
        f"- TP=2 (a core each) / TP=1 (one core): **{result['summary'][KEY]:.2f}x**; "
        f"PP=2 (a core per stage) / TP=1: **{result['summary'][PP_KEY]:.2f}x** "
        f"({result['target']}).",
        f"- Rank 0's collectives, one more TP=2 run of {c['wall_seconds']:.2f} s: "
        f"**{c['collective_share']:.3f}** of its wall time ({parts(c)}; all-reduce time includes "
        f"waiting for rank 1). Per step ({c['steps']} steps): {c['all_reduce_per_step']:.0f} "
        f"all-reduces, one broadcast of {b['bytes_per_step']['mean']:.0f} B pickled on average "
        f"(max {b['bytes_per_step']['max']}) taking {b['seconds_per_step'] * 1e3:.3f} ms.",
        f"- Stage 0's p2p, one more PP=2 run of {p['wall_seconds']:.2f} s: **{p['p2p_share']:.3f}**"
        f" of its wall time in send_forward and recv_output ({parts(p)}). recv_output is stage 0 "
        f"waiting for stage 1's layers ({p['recv_output_seconds_per_step'] * 1e3:.2f} ms a step); "
        f"send_forward moves {f['bytes_per_step'] / 1e3:.1f} kB a step in "
        f"{f['seconds_per_step'] * 1e3:.3f} ms. Not faster: {pp['why_not_faster']}.",
        f"- The multi-rank engines' start (worker process, rendezvous, its shard loaded): TP=2 "
        f"{tp['engine_start_seconds']:.1f} s, PP=2 {pp['engine_start_seconds']:.1f} s, not timed. "
        f"Load average (1 min) before and after: "
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
    colors = ["tab:gray", "tab:olive", "tab:green", "tab:blue"]
    ax.bar(names, medians, yerr=errors, color=colors[: len(names)])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Tensor and pipeline parallelism ({result['workload']['requests']} requests, "
        f"{result['dtype']}, {result['device']})"
    )
    for x, y in enumerate(medians):
        ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom")
    return [plots.save(fig, out_dir / "parallel_throughput.png", dpi=110)]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
