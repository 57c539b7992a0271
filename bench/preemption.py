"""Preemption under KV-cache pressure: recompute vs swap, against a run without pressure.

One workload (prompts 32-256 tokens, outputs 64-192, greedy, EOS ignored, all requests at once)
runs on three fresh engines per repeat, interleaved in rotating order:

- baseline: a KV pool holding every sequence at its full length (no preemption);
- recompute: a pool of about 40% of that (`num_blocks`), so running sequences outgrow it and the
  newest is preempted, its blocks freed and its tokens recomputed on readmission;
- swap: the same pool, preempted sequences' blocks copied to a host pool (`swap_space`, sized to
  hold every sequence, so no swap falls back to recompute) and copied back on resumption.

Reported per mode: output tokens per second, TTFT p50 / p99 (the engine's clock, arrival at the
start of the run) and the engine's preemption count. Greedy outputs must be identical in all
three modes: on a smaller workload before timing, and on every timed run.

    python -m bench.preemption [--quick] [--threads 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench import cli, plots
from bench.batching_spread import PRESETS as SPREAD_PRESETS
from bench.llm import Workload, check_same, greedy, make_workload, new_engine, time_to_first_token
from bench.output import progress
from bench.skeleton import Benchmark
from bench.timing import p50_p99_ms, spread, timed
from tooling.checkpoints import build_random_llama

NAME = "preemption"
HEADING = "Preemption under KV pressure: recompute vs swap"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=2)
MODES = ("baseline", "recompute", "swap")
BLOCK_SIZE = 16
POOL_FRACTION = 0.4
"""The pressured pool, as a share of the blocks all sequences need at their full length."""
SWAP_SPACE_GB = 0.25


PRESETS = {  # the models of bench.batching_spread
    "quick": replace(
        SPREAD_PRESETS["quick"].sizes, requests=8, prompt_len=(16, 64), output_len=(16, 48)
    ),
    "cpu": replace(
        SPREAD_PRESETS["cpu"].sizes, requests=32, prompt_len=(32, 256), output_len=(64, 192)
    ),
    "cuda": replace(
        SPREAD_PRESETS["cuda"].sizes, requests=64, prompt_len=(32, 256), output_len=(64, 192)
    ),
}


@dataclass
class ModeRun:
    outputs: list[list[int]]
    seconds: float
    ttft: list[float]
    preemptions: int


def blocks_needed(workload: Workload) -> int:
    """Blocks every sequence holds at its full length (prompt + output)."""
    return sum(
        -(-(len(p) + n) // BLOCK_SIZE)
        for p, n in zip(workload.prompts, workload.output_lens, strict=True)
    )


def mode_settings(workload: Workload, max_model_len: int) -> dict[str, dict]:
    """LLMConfig settings per mode."""
    demand = blocks_needed(workload)
    pressured = max(round(POOL_FRACTION * demand), -(-max_model_len // BLOCK_SIZE))
    common = {
        "max_model_len": max_model_len,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": len(workload.prompts),
    }
    return {
        "baseline": {**common, "num_blocks": demand},
        "recompute": {**common, "num_blocks": pressured, "preemption_mode": "recompute"},
        "swap": {
            **common,
            "num_blocks": pressured,
            "preemption_mode": "swap",
            "swap_space": SWAP_SPACE_GB,
        },
    }


def run_mode(model_dir: Path, device, dtype: str, settings: dict, workload: Workload) -> ModeRun:
    """The workload on a fresh engine with these settings (construction not timed)."""
    engine = new_engine(model_dir, device, dtype, **settings)
    if engine.runner.num_host_blocks and engine.runner.num_host_blocks < blocks_needed(workload):
        raise SystemExit(f"swap_space {SWAP_SPACE_GB} GiB cannot hold every sequence")
    outputs, seconds = timed(
        lambda: engine.generate(workload.prompts, [greedy(n) for n in workload.output_lens])
    )()
    return ModeRun(
        [o.outputs[0].token_ids for o in outputs],
        seconds,
        [time_to_first_token(o) for o in outputs],
        engine.stats().counters.num_preemptions,
    )


def check_modes(runs: dict[str, ModeRun], dtype: str) -> dict:
    """Identical greedy outputs in every mode; the pressured modes must really preempt."""
    if runs["baseline"].preemptions:
        raise SystemExit("the baseline pool was too small: it preempted")
    for name in ("recompute", "swap"):
        if not runs[name].preemptions:
            raise SystemExit(f"{name}: no preemption happened; the pool is not under pressure")
    others = {name: r.outputs for name, r in runs.items() if name != "baseline"}
    return check_same("baseline", runs["baseline"].outputs, others, dtype)


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    sizes = PRESETS[cli.mode(args.quick, device)]
    max_model_len = sizes.prompt_len[1] + sizes.output_len[1]
    num_params = build_random_llama(sizes, model_dir, args.seed)
    workload = make_workload(sizes, args.seed)
    settings = mode_settings(workload, max_model_len)
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}, {sizes.requests} "
        f"requests, {workload.num_output_tokens} output tokens; KV pool "
        f"{settings['baseline']['num_blocks']} blocks (baseline), "
        f"{settings['recompute']['num_blocks']} (under pressure)"
    )

    def run_all(work: Workload, modes: tuple[str, ...], sets: dict) -> dict[str, ModeRun]:
        return {name: run_mode(model_dir, device, dtype, sets[name], work) for name in modes}

    # Fidelity first (also a warm-up): half the requests, shorter outputs, the same pool share.
    check = Workload(
        workload.prompts[: len(workload.prompts) // 2],
        [n // 3 for n in workload.output_lens[: len(workload.prompts) // 2]],
    )
    fidelity = {
        "before_timing": check_modes(
            run_all(check, MODES, mode_settings(check, max_model_len)), dtype
        )
    }
    runs: dict[str, list[ModeRun]] = {name: [] for name in MODES}
    for rep in range(args.repeats):
        # Every mode, in an order rotating each repeat.
        this = run_all(workload, MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)], settings)
        for name in MODES:
            runs[name].append(this[name])
            progress(
                f"repeat {rep + 1}/{args.repeats} {name}: {this[name].seconds:.2f} s, "
                f"{this[name].preemptions} preemptions"
            )
        fidelity[f"repeat_{rep + 1}"] = check_modes(this, dtype)

    tokens = workload.num_output_tokens
    rate = {name: spread([tokens / r.seconds for r in rs]) for name, rs in runs.items()}
    ttft = {name: [t for r in rs for t in r.ttft] for name, rs in runs.items()}
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": {
            "requests": sizes.requests,
            "prompt_len": sizes.prompt_len,
            "output_len": sizes.output_len,
            "output_tokens": tokens,
            "blocks_needed": blocks_needed(workload),
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "settings": {
            "engines": settings,
            "pool_fraction": POOL_FRACTION,
            "torch_threads": args.threads,
        },
        "repeats": args.repeats,
        "seconds": {name: [r.seconds for r in rs] for name, rs in runs.items()},
        "output_tokens_per_second": rate,
        "ttft_ms": {name: p50_p99_ms(v) for name, v in ttft.items()},
        "preemptions": {name: [r.preemptions for r in rs] for name, rs in runs.items()},
        "fidelity": fidelity,
        "summary": {
            "swap_vs_recompute_throughput": rate["swap"]["median"] / rate["recompute"]["median"]
        },
    }


def report(result: dict) -> list[str]:
    w, engines = result["workload"], result["settings"]["engines"]
    lines = [
        f"{w['requests']} requests (prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, outputs "
        f"{w['output_len'][0]}-{w['output_len'][1]} tokens) at once. baseline: a pool holding "
        f"every sequence ({engines['baseline']['num_blocks']} blocks); recompute and swap: "
        f"{engines['recompute']['num_blocks']} blocks ({result['settings']['pool_fraction']:.0%}). "
        f"Median of {result['repeats']} run(s) in rotating order, {result['dtype']} on "
        f"{result['device']}; greedy outputs identical in all modes.",
        "",
        "| mode | output tok/s (min-max) | TTFT p50 (ms) | TTFT p99 (ms) | preemptions |",
        "|---|---|---|---|---|",
    ]
    for name in MODES:
        rate, ttft = result["output_tokens_per_second"][name], result["ttft_ms"][name]
        lines.append(
            f"| {name} | {rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f}) | "
            f"{ttft['p50']:.0f} | {ttft['p99']:.0f} | "
            f"{statistics.median(result['preemptions'][name]):.0f} |"
        )
    ratio = result["summary"]["swap_vs_recompute_throughput"]
    return lines + [
        "",
        f"swap / recompute throughput: {ratio:.2f}x. No target: this records "
        "which policy is cheaper for this model and device.",
    ]


def plot(result: dict, out_dir: Path) -> list[Path]:
    fig, (left, right) = plots.pyplot().subplots(1, 2, figsize=(10, 4))
    rates = [result["output_tokens_per_second"][m]["median"] for m in MODES]
    left.bar(MODES, rates, color=["gray", "tab:blue", "tab:orange"])
    left.set_ylabel("output tokens/s")
    left.set_title("Throughput")
    x = range(len(MODES))
    for offset, key in ((-0.2, "p50"), (0.2, "p99")):
        right.bar(
            [i + offset for i in x],
            [result["ttft_ms"][m][key] for m in MODES],
            0.4,
            label=f"TTFT {key}",
        )
    right.set_xticks(list(x), MODES)
    right.set_ylabel("ms")
    right.set_title("Time to first token")
    right.legend()
    fig.suptitle("Preemption under KV pressure")
    return [plots.save(fig, out_dir / f"{NAME}_modes.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
