"""Continuous vs static batching as the spread of output lengths grows.

The same prompts (32 requests, 64-128 tokens) get output lengths drawn uniformly from
[mean*(1-s), mean*(1+s)] (mean 96) for each spread s in {0, 0.5, 1}; EOS ignored, greedy. Systems,
all with the same batch size B (`static_batch`):

- continuous: `LLMEngine.generate` of every request, at most B running at once (max_num_seqs=B):
  a finished request's slot goes to the next one at the following step;
- static_engine: static batching done with the same engine: batches of B requests in arrival
  order, each one `generate` call in which every request is asked for the batch's longest output
  (so all B slots stay busy until the longest finishes, as in a static batch), the next batch only
  after it; only the requested tokens count as useful;
- hf_static: transformers `generate` on left-padded batches of B (bench.engine.hf_static).

Figures are useful output tokens per second; static batching wastes the slots of requests that
finished before their batch's longest, so it needs more engine steps (counted) for the same useful
tokens as the spread grows. Greedy outputs are compared on a small workload before timing and on
every timed run (the requested tokens).

Its model presets (PRESETS) are shared by bench.prefix_cache, bench.kv_memory and
bench.preemption; the helpers of all LLM-engine benchmarks live in bench.llm.

    python -m bench.batching_spread [--quick] [--threads 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli, plots
from bench.engine import hf_static
from bench.llm import Workload, check_same, greedy, load_hf_model, new_engine
from bench.output import progress
from bench.skeleton import Benchmark
from bench.timing import spread, time_interleaved, timed
from tooling.checkpoints import Sizes, build_random_llama

NAME = "batching_spread"
HEADING = "Continuous vs static batching under output-length spread"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=1)


@dataclass(frozen=True)
class Preset:
    sizes: Sizes
    """Model, request count, prompt lengths and the batch size B (static_batch)."""
    mean_output: int
    spreads: tuple[float, ...]


def _sizes(
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    requests: int,
    prompt: tuple[int, int],
    mean: int,
    batch: int,
) -> Sizes:
    return Sizes(
        hidden=hidden,
        intermediate=3 * hidden,
        layers=layers,
        heads=heads,
        kv_heads=2,
        vocab=vocab,
        requests=requests,
        prompt_len=prompt,
        output_len=(1, 2 * mean),
        static_batch=batch,
    )


PRESETS = {  # about 9M parameters on CPU, 0.2B on CUDA
    "quick": Preset(_sizes(128, 2, 4, 1024, 8, (16, 32), 12, 4), 12, (0.0, 1.0)),
    "cpu": Preset(_sizes(256, 6, 4, 8192, 32, (64, 128), 96, 8), 96, (0.0, 0.5, 1.0)),
    "cuda": Preset(_sizes(1024, 12, 16, 32000, 64, (64, 128), 96, 16), 96, (0.0, 0.5, 1.0)),
}


def output_lens(count: int, mean: int, spread_: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    low, high = max(1, round(mean * (1 - spread_))), round(mean * (1 + spread_))
    return [rng.randint(low, high) for _ in range(count)]


class Systems:
    """The three systems on one checkpoint; each run returns (outputs, seconds)."""

    def __init__(self, model_dir: Path, device, dtype: str, batch: int, max_len: int):
        self.batch = batch
        self.steps: dict[str, int] = {}
        """Engine steps of each engine system's latest run."""
        # No KV pressure: the pool holds B sequences of max_model_len.
        self.settings = {
            "max_model_len": max_len,
            "max_num_seqs": batch,
            "num_blocks": batch * -(-max_len // 16),
        }
        self.new_engine = lambda: new_engine(model_dir, device, dtype, **self.settings)
        self.hf = load_hf_model(model_dir, device, dtype)

    def engine(self, name: str):
        """A fresh engine whose steps are counted in self.steps[name]."""
        engine = self.new_engine()
        step, self.steps[name] = engine.step, 0

        def counted_step():
            self.steps[name] += 1
            return step()

        engine.step = counted_step
        return engine

    def continuous(self, workload: Workload) -> tuple[list[list[int]], float]:
        engine = self.engine("continuous")  # built before the clock starts, as in each system
        outputs, seconds = timed(
            lambda: engine.generate(workload.prompts, [greedy(n) for n in workload.output_lens])
        )()
        return [o.outputs[0].token_ids for o in outputs], seconds

    def static_engine(self, workload: Workload) -> tuple[list[list[int]], float]:
        engine = self.engine("static_engine")
        return timed(lambda: self._static_batches(engine, workload))()

    def _static_batches(self, engine, workload: Workload) -> list[list[int]]:
        results = []
        for start in range(0, len(workload.prompts), self.batch):
            lens = workload.output_lens[start : start + self.batch]
            outputs = engine.generate(
                workload.prompts[start : start + self.batch], greedy(max(lens))
            )
            results += [o.outputs[0].token_ids[:n] for o, n in zip(outputs, lens, strict=True)]
        return results

    def all(self, workload: Workload) -> dict:
        """Each system on `workload`, returning (outputs, seconds)."""
        return {
            "continuous": lambda: self.continuous(workload),
            "static_engine": lambda: self.static_engine(workload),
            "hf_static": timed(lambda: hf_static(self.hf, workload, self.batch)),
        }


def static_slots(lens: list[int], batch: int) -> int:
    """Output slots a static batch occupies: every request to its batch's longest output."""
    return sum(
        len(lens[i : i + batch]) * max(lens[i : i + batch]) for i in range(0, len(lens), batch)
    )


def spread_record(
    spread_: float, workload: Workload, seconds: dict[str, list[float]], steps: dict, batch: int
) -> dict:
    """One spread's figures, for the result JSON."""
    tokens = workload.num_output_tokens
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "spread": spread_,
        "output_lens": workload.output_lens,
        "useful_tokens": tokens,
        "static_useful_share": tokens / static_slots(workload.output_lens, batch),
        "engine_steps": dict(steps),
        "seconds": seconds,
        "tokens_per_second": {name: spread([tokens / t for t in s]) for name, s in seconds.items()},
        "continuous_speedup": {
            name: median[name] / median["continuous"] for name in median if name != "continuous"
        },
    }


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    sizes = preset.sizes
    num_params = build_random_llama(sizes, model_dir, args.seed)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, sizes.vocab) for _ in range(rng.randint(*sizes.prompt_len))]
        for _ in range(sizes.requests)
    ]
    max_len = sizes.prompt_len[1] + 2 * preset.mean_output
    systems = Systems(model_dir, device, dtype, sizes.static_batch, max_len)
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}, "
        f"{sizes.requests} requests, B={sizes.static_batch}"
    )

    # Fidelity first (also warms every system up): two static batches of varied lengths.
    check = Workload(
        prompts[: 2 * sizes.static_batch], output_lens(2 * sizes.static_batch, 12, 0.5, args.seed)
    )
    outputs = {name: system()[0] for name, system in systems.all(check).items()}
    fidelity = {
        "before_timing": check_same("continuous", outputs.pop("continuous"), outputs, dtype)
    }

    runs = []
    for index, spread_ in enumerate(preset.spreads):
        workload = Workload(
            prompts, output_lens(sizes.requests, preset.mean_output, spread_, args.seed + 1 + index)
        )
        progress(f"spread {spread_}: {workload.num_output_tokens} useful output tokens")
        seconds, outputs = time_interleaved(systems.all(workload), args.repeats)
        fidelity[f"spread_{spread_}"] = check_same(
            "continuous", outputs.pop("continuous"), outputs, dtype
        )
        runs.append(spread_record(spread_, workload, seconds, systems.steps, sizes.static_batch))

    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": {
            "requests": sizes.requests,
            "prompt_len": sizes.prompt_len,
            "mean_output": preset.mean_output,
            "spreads": preset.spreads,
            "batch_size": sizes.static_batch,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "settings": {
            "engine": systems.settings,
            "hf_attn_implementation": "sdpa",
            "torch_threads": args.threads,
        },
        "repeats": args.repeats,
        "runs": runs,
        "fidelity": fidelity,
        "summary": {
            "continuous_vs_static_at_max_spread": runs[-1]["continuous_speedup"]["static_engine"]
        },
    }


def report(result: dict) -> list[str]:
    runs = result["runs"]
    w = result["workload"]
    lines = [
        f"{w['requests']} requests (prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens), "
        f"output lengths uniform in [mean·(1-s), mean·(1+s)], mean {w['mean_output']}; batch size "
        f"B={w['batch_size']} for all systems. continuous: our engine, at most B running; "
        "static_engine: our engine fed one batch of B at a time, every request run to its batch's "
        "longest output; hf_static: transformers `generate` on batches of B. Useful (requested) "
        f"output tokens/s, median of {result['repeats']} run(s), {result['dtype']} on "
        f"{result['device']}; greedy outputs identical across systems. Engine steps: how many "
        "steps each engine run took (the gain continuous batching gives where steps cost alike).",
        "",
        "| spread s | continuous tok/s | static_engine tok/s | hf_static tok/s | continuous / "
        "static_engine | continuous / hf_static | static useful share | engine steps static / "
        "continuous |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rate = {name: r["tokens_per_second"][name]["median"] for name in r["tokens_per_second"]}
        steps = r["engine_steps"]
        lines.append(
            f"| {r['spread']} | {rate['continuous']:.0f} | {rate['static_engine']:.0f} | "
            f"{rate['hf_static']:.0f} | {r['continuous_speedup']['static_engine']:.2f}x | "
            f"{r['continuous_speedup']['hf_static']:.2f}x | {r['static_useful_share']:.2f} | "
            f"{steps['static_engine']} / {steps['continuous']} |"
        )
    gain = [r["continuous_speedup"]["static_engine"] for r in runs]
    lines += [
        "",
        f"Expectation: the continuous/static gain grows with the spread: "
        f"{gain[0]:.2f}x at s={runs[0]['spread']} -> {gain[-1]:.2f}x at s={runs[-1]['spread']}"
        f" — {'met' if gain[-1] > gain[0] else 'NOT met'}.",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    runs = result["runs"]
    spreads = [r["spread"] for r in runs]
    fig, ax = plots.pyplot().subplots(figsize=(6, 4))
    for name in runs[0]["tokens_per_second"]:
        ax.plot(
            spreads, [r["tokens_per_second"][name]["median"] for r in runs], marker="o", label=name
        )
    ax.set_xlabel("output-length spread s")
    ax.set_ylabel("useful output tokens/s")
    ax.set_title(f"Throughput vs output-length spread (B={result['workload']['batch_size']})")
    ax.set_ylim(bottom=0)
    ax.legend()
    return [plots.save(fig, out_dir / f"{NAME}_throughput.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
