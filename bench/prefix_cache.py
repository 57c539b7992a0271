"""Time to first token with a shared system prompt, prefix cache on vs off.

16 requests share a long prefix (1024 tokens) and differ in a short suffix (64 tokens).
They arrive one after another, each added only once the previous one finished, so each runs alone
and its TTFT (add -> first token, by the engine's clock: `RequestMetrics`) is its prefill time.
Modes: `enable_prefix_caching` on and off, each on a fresh engine per repeat, interleaved. Both
engines first serve one warm-up request (the shared prefix with another suffix): with the cache on
it fills the cache, so the measured requests only prefill their suffix; with it off it merely
warms the same code paths. Greedy outputs must be identical in both modes. The hit rate is the
engine's own counter (prefix-cache hit tokens / looked-up tokens) over the measured requests.

    python -m bench.prefix_cache [--quick] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli, plots
from bench.batching_spread import PRESETS as SPREAD_PRESETS
from bench.llm import check_same, greedy, new_engine, time_to_first_token
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target
from bench.timing import p50_p99_ms, spread
from tooling.checkpoints import Sizes, build_random_llama

NAME = "prefix_cache"
HEADING = "Prefix cache: time to first token with a shared system prompt"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=3)
TARGET = target("prefix_cache_ttft_reduction")
MODES = ("cache_off", "cache_on")
_request_ids = itertools.count()


@dataclass(frozen=True)
class Preset:
    sizes: Sizes
    prefix_len: int
    suffix_len: int
    requests: int
    output_len: int


PRESETS = {  # the model of bench.batching_spread, per device
    "quick": Preset(SPREAD_PRESETS["quick"].sizes, 256, 32, 6, 4),
    "cpu": Preset(SPREAD_PRESETS["cpu"].sizes, 1024, 64, 16, 4),
    "cuda": Preset(SPREAD_PRESETS["cuda"].sizes, 1024, 64, 16, 4),
}


def make_prompts(preset: Preset, count: int, seed: int) -> tuple[list[int], list[list[int]]]:
    """The warm-up prompt and `count` prompts: one shared prefix, each its own suffix."""
    rng = random.Random(seed)
    vocab = preset.sizes.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = tokens(preset.prefix_len)
    warmup, *prompts = [prefix + tokens(preset.suffix_len) for _ in range(count + 1)]
    return warmup, prompts


def serve_one_by_one(
    engine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[float]]:
    """Run each prompt alone to completion; greedy outputs and TTFTs (seconds)."""
    outputs, ttfts = [], []
    for prompt in prompts:
        engine.add_request(
            f"r{next(_request_ids)}", None, greedy(max_tokens), prompt_token_ids=prompt
        )
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        outputs.append(final.outputs[0].token_ids)
        ttfts.append(time_to_first_token(final))
    return outputs, ttfts


def run_mode(
    model_dir: Path,
    device,
    dtype: str,
    settings: dict,
    caching: bool,
    warmup: list[int],
    prompts: list[list[int]],
    max_tokens: int,
) -> dict:
    """A fresh engine: the warm-up request, then the measured ones (outputs, TTFTs, hit rate)."""
    engine = new_engine(model_dir, device, dtype, enable_prefix_caching=caching, **settings)
    serve_one_by_one(engine, [warmup], max_tokens)
    before = engine.stats().counters
    outputs, ttfts = serve_one_by_one(engine, prompts, max_tokens)
    counters = engine.stats().counters - before
    hit_rate = (
        counters.prefix_cache_hits / counters.prefix_cache_queries
        if counters.prefix_cache_queries
        else 0.0
    )
    return {"outputs": outputs, "ttft": ttfts, "hit_rate": hit_rate}


def time_modes(
    mode, prompts: list[list[int]], repeats: int, dtype: str
) -> tuple[dict[str, list[dict]], dict]:
    """`mode(caching, prompts)` for both modes, `repeats` times in alternating order; the runs,
    and the output check of each repeat."""
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    fidelity = {}
    for rep in range(repeats):
        for name in MODES if rep % 2 == 0 else MODES[::-1]:
            runs[name].append(mode(name == "cache_on", prompts))
            progress(
                f"repeat {rep + 1}/{repeats} {name}: median TTFT "
                f"{statistics.median(runs[name][-1]['ttft']) * 1e3:.1f} ms"
            )
        fidelity[f"repeat_{rep + 1}"] = check_same(
            "cache_off",
            runs["cache_off"][-1]["outputs"],
            {"cache_on": runs["cache_on"][-1]["outputs"]},
            dtype,
        )
    return runs, fidelity


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    max_len = preset.prefix_len + preset.suffix_len + preset.output_len
    num_params = build_random_llama(preset.sizes, model_dir, args.seed, max_positions=max_len)
    # Room for the cached prefix plus a few requests; no eviction of the prefix.
    settings = {
        "max_model_len": max_len,
        "num_blocks": 4 * -(-max_len // 16),
        "max_num_batched_tokens": max(2048, max_len),
    }
    warmup, prompts = make_prompts(preset, preset.requests, args.seed)
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}, "
        f"{preset.requests} requests of {preset.prefix_len}+{preset.suffix_len} tokens"
    )

    def mode(caching: bool, measured: list[list[int]]) -> dict:
        return run_mode(
            model_dir, device, dtype, settings, caching, warmup, measured, preset.output_len
        )

    # Fidelity first (also a warm-up): a few requests in both modes.
    check = {name: mode(name == "cache_on", prompts[:3])["outputs"] for name in MODES}
    fidelity = {
        "before_timing": check_same(
            "cache_off", check["cache_off"], {"cache_on": check["cache_on"]}, dtype
        )
    }
    runs, repeat_checks = time_modes(mode, prompts, args.repeats, dtype)
    fidelity.update(repeat_checks)
    ttft = {name: [t for r in runs[name] for t in r["ttft"]] for name in MODES}
    reductions = [
        1 - statistics.median(on["ttft"]) / statistics.median(off["ttft"])
        for on, off in zip(runs["cache_on"], runs["cache_off"], strict=True)
    ]
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(preset.sizes), "parameters": num_params},
        "workload": {
            "prefix_len": preset.prefix_len,
            "suffix_len": preset.suffix_len,
            "requests": preset.requests,
            "output_len": preset.output_len,
            "arrival": "one after another, each alone",
            "warmup_requests": 1,
            "seed": args.seed,
        },
        "settings": {"engine": settings, "torch_threads": args.threads},
        "repeats": args.repeats,
        "ttft_seconds": ttft,
        "ttft_ms": {name: p50_p99_ms(v) for name, v in ttft.items()},
        "hit_rate": {name: [r["hit_rate"] for r in runs[name]] for name in MODES},
        "ttft_reduction": spread(reductions),
        "fidelity": fidelity,
        "summary": {"prefix_cache_ttft_reduction": statistics.median(reductions)},
    }


def report(result: dict) -> list[str]:
    w, ms = result["workload"], result["ttft_ms"]
    reduction = result["summary"]["prefix_cache_ttft_reduction"]
    lines = [
        f"{w['requests']} requests = one shared {w['prefix_len']}-token prefix + a unique "
        f"{w['suffix_len']}-token suffix, arriving one after another (each alone, so TTFT is its "
        "prefill); fresh engine per mode and repeat, each first serving one warm-up request with "
        f"the same prefix (it fills the cache when on). {result['repeats']} repeat(s), "
        f"{result['dtype']} on {result['device']}; greedy outputs identical on and off.",
        "",
        "| prefix cache | TTFT p50 (ms) | TTFT p99 (ms) | hit rate (tokens) |",
        "|---|---|---|---|",
    ]
    for name in MODES:
        hits = statistics.median(result["hit_rate"][name])
        lines.append(
            f"| {name.removeprefix('cache_')} | {ms[name]['p50']:.1f} | "
            f"{ms[name]['p99']:.1f} | {hits:.3f} |"
        )
    r = result["ttft_reduction"]
    lines += [
        "",
        f"TTFT reduction 1 - median(on)/median(off): {reduction:.3f} "
        f"(min {r['min']:.3f}, max {r['max']:.3f} over repeats).",
        summary_line("prefix_cache_ttft_reduction", reduction, f">= {TARGET}", reduction >= TARGET),
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, ax = plots.pyplot().subplots(figsize=(6, 4))
    everything = [t * 1e3 for name in MODES for t in result["ttft_seconds"][name]]
    for name in MODES:
        ax.step(
            *plots.cdf(t * 1e3 for t in result["ttft_seconds"][name]),
            where="post",
            label=f"prefix cache {name.removeprefix('cache_')}",
        )
    ax.set_xscale("log")  # both modes readable although an order of magnitude apart
    ax.set_xlim(min(everything) / 1.5, max(everything) * 1.5)
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, shared {result['workload']['prefix_len']}-token prefix")
    ax.legend()
    return [plots.save(fig, out_dir / f"{NAME}_ttft_cdf.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
