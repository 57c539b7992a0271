"""KV-cache memory: how much of the paged pool holds real tokens, and how many sequences fit.

(a) Utilization: a mixed workload (prompts 32-512 tokens, outputs 32-256, greedy, EOS ignored,
all requests at once) runs on a fixed KV pool (`num_blocks`). After every `schedule()` we sample
the tokens held by running sequences (computed plus scheduled in this step) and the KV slots
allocated (blocks in use x block_size). Reported: tokens / slots at the step of peak allocation,
and what contiguous preallocation of max_model_len per sequence would use for the same sequences:
tokens / (sequences x max_model_len).

(b) Concurrency: for the same pool in tokens, the most sequences of that length distribution
(prompt + output lengths) resident at once. Paged: MEASURED by offering many requests whose prompt
is the whole sequence (max_tokens=1, so nothing grows and nothing is preempted) at once to an
engine with that pool, empty, and max_num_seqs and a step token budget too large to bind:
admission stops when the pool is out of blocks; the sequences running in that first step are
compared with block arithmetic (first-come first-served: sum of ceil(len / block_size) <= pool). Contiguous preallocation fits
pool_tokens // max_model_len sequences. Both at max_model_len 2048 and 8192.

Block accounting does not depend on the model, so a small one is used.

    python -m bench.kv_memory [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench import cli, plots
from bench.batching_spread import PRESETS as SPREAD_PRESETS
from bench.llm import greedy, make_workload, new_engine
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target
from bench.timing import spread
from tooling.checkpoints import Sizes, build_random_llama

NAME = "kv_memory"
HEADING = "KV-cache memory: paged utilization and concurrency"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=1)
UTILIZATION_TARGET = target("kv_slot_utilization")
MAX_MODEL_LENS = (2048, 8192)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Preset:
    workload: Sizes
    """Model and the mixed workload of (a)."""
    num_blocks: int
    """The fixed KV pool of (a) and (b)."""
    num_sequences: int
    """Requests offered in (b): more than the pool holds."""


_SMALL = SPREAD_PRESETS["quick"].sizes  # 0.7M parameters
_MIXED = {"prompt_len": (32, 512), "output_len": (32, 256)}
PRESETS = {
    "quick": Preset(
        replace(_SMALL, requests=16, prompt_len=(32, 256), output_len=(8, 32)), 512, 80
    ),
    "cpu": Preset(replace(_SMALL, requests=64, **_MIXED), 1024, 96),
    "cuda": Preset(replace(SPREAD_PRESETS["cuda"].sizes, requests=64, **_MIXED), 1024, 96),
}


@dataclass
class StepSample:
    seconds: float
    running: int
    tokens: int
    """Tokens whose K/V running sequences hold once this step ran."""
    slots: int
    """Allocated blocks x block_size."""


def record_kv_usage(engine) -> list[StepSample]:
    """Wrap the engine's `Scheduler.schedule` to sample KV accounting after every schedule."""
    scheduler = engine.scheduler
    pool, block_size = scheduler.kv_cache_manager.pool, scheduler.config.block_size
    inner, samples, started = scheduler.schedule, [], time.perf_counter()

    def schedule():
        out = inner()
        new = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
        tokens = sum(s.num_computed_tokens + new.get(s.seq_id, 0) for s in scheduler.running)
        samples.append(
            StepSample(
                time.perf_counter() - started,
                len(scheduler.running),
                tokens,
                (pool.num_blocks - pool.num_free_blocks) * block_size,
            )
        )
        return out

    scheduler.schedule = schedule
    return samples


def utilization_run(model_dir: Path, device, dtype: str, preset: Preset, seed: int) -> dict:
    """(a): the mixed workload on the fixed pool; the step series and the peak."""
    workload = make_workload(preset.workload, seed)
    engine = new_engine(
        model_dir,
        device,
        dtype,
        max_model_len=MAX_MODEL_LENS[0],
        num_blocks=preset.num_blocks,
        block_size=BLOCK_SIZE,
    )
    samples = record_kv_usage(engine)
    started = time.perf_counter()
    engine.generate(workload.prompts, [greedy(n) for n in workload.output_lens])
    seconds = time.perf_counter() - started
    peak = max(samples, key=lambda s: s.slots)  # the first step at the highest allocation
    return {
        "seconds": seconds,
        "samples": samples,
        "peak": peak,
        "preemptions": engine.stats().counters.num_preemptions,
        "output_tokens": workload.num_output_tokens,
    }


def sequence_lengths(preset: Preset, seed: int) -> list[int]:
    """Prompt + output lengths of the workload's distribution, `num_sequences` of them."""
    workload = make_workload(replace(preset.workload, requests=preset.num_sequences), seed + 1)
    return [len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True)]


def paged_capacity(lengths: list[int], num_blocks: int) -> int:
    """First-come first-served: how many leading sequences' blocks fit in the pool."""
    used = 0
    for count, length in enumerate(lengths):
        used += -(-length // BLOCK_SIZE)
        if used > num_blocks:
            return count
    return len(lengths)


def measured_concurrency(
    model_dir: Path,
    device,
    dtype: str,
    lengths: list[int],
    num_blocks: int,
    max_model_len: int,
    seed: int,
) -> tuple[int, int]:
    """(b): sequences running after the first step when all `lengths` are offered to an empty
    pool at once, and preemptions; the rest are aborted (their count is all that matters)."""
    engine = new_engine(
        model_dir,
        device,
        dtype,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=len(lengths),
        max_num_batched_tokens=sum(lengths),
        enable_prefix_caching=False,
    )
    samples = record_kv_usage(engine)
    rng = random.Random(seed)
    for index, length in enumerate(lengths):
        prompt = [rng.randrange(3, engine.vocab_size) for _ in range(length)]
        engine.add_request(f"s{index}", None, greedy(1), prompt_token_ids=prompt)
    engine.step()  # admits until the pool is out of blocks; the token budget never binds
    for index in range(len(lengths)):
        engine.abort_request(f"s{index}")
    return samples[0].running, engine.stats().counters.num_preemptions


def concurrency_at(
    model_dir: Path,
    device,
    dtype: str,
    preset: Preset,
    lengths: list[int],
    max_len: int,
    seed: int,
) -> dict:
    """(b) at one max_model_len: measured paged concurrency (checked against block arithmetic)
    and contiguous preallocation's."""
    expected = paged_capacity(lengths, preset.num_blocks)
    paged, preemptions = measured_concurrency(
        model_dir, device, dtype, lengths, preset.num_blocks, max_len, seed
    )
    if paged != expected or preemptions:
        raise SystemExit(
            f"max_model_len {max_len}: {paged} sequences resident ({preemptions} "
            f"preemptions), block arithmetic says {expected}"
        )
    contiguous = preset.num_blocks * BLOCK_SIZE // max_len
    progress(f"(b) max_model_len {max_len}: paged {paged}, contiguous {contiguous}")
    return {
        "paged": paged,
        "paged_expected": expected,
        "contiguous": contiguous,
        "gain": paged / contiguous,
    }


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    num_params = build_random_llama(
        preset.workload, model_dir, args.seed, max_positions=max(MAX_MODEL_LENS)
    )
    pool_tokens = preset.num_blocks * BLOCK_SIZE
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}, pool "
        f"{preset.num_blocks} blocks x {BLOCK_SIZE} = {pool_tokens} tokens"
    )

    runs = [
        utilization_run(model_dir, device, dtype, preset, args.seed) for _ in range(args.repeats)
    ]
    series = [[asdict(s) | {"seconds": 0.0} for s in r["samples"]] for r in runs]
    if any(s != series[0] for s in series):
        raise SystemExit("KV accounting differs between repeats of the same workload")
    a = runs[0]
    peak = a["peak"]
    progress(f"(a) peak: {peak.tokens} tokens in {peak.slots} slots, {peak.running} sequences")

    lengths = sequence_lengths(preset, args.seed)
    concurrency = {
        str(max_len): concurrency_at(model_dir, device, dtype, preset, lengths, max_len, args.seed)
        for max_len in MAX_MODEL_LENS
    }

    utilization = peak.tokens / peak.slots
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(preset.workload), "parameters": num_params},
        "workload": {
            "requests": preset.workload.requests,
            "prompt_len": preset.workload.prompt_len,
            "output_len": preset.workload.output_len,
            "seed": args.seed,
            "concurrency_sequences": preset.num_sequences,
            "concurrency_lengths": spread(lengths),
        },
        "settings": {
            "num_blocks": preset.num_blocks,
            "block_size": BLOCK_SIZE,
            "pool_tokens": pool_tokens,
            "max_model_len": MAX_MODEL_LENS[0],
            "torch_threads": args.threads,
        },
        "repeats": args.repeats,
        "seconds": [r["seconds"] for r in runs],
        "utilization": {
            "peak": asdict(peak),
            "slot_utilization": utilization,
            "preemptions": a["preemptions"],
            "output_tokens": a["output_tokens"],
            "contiguous_utilization": {
                str(n): peak.tokens / (peak.running * n) for n in MAX_MODEL_LENS
            },
            "series": [asdict(s) for s in a["samples"]],
        },
        "concurrency": concurrency,
        "fidelity": {
            "deterministic_accounting": True,
            "paged_count_matches_blocks": True,
            "no_preemption_in_b": True,
            "passed": True,
        },
        "summary": {
            "kv_slot_utilization": utilization,
            "concurrency_gain_vs_preallocation": concurrency[str(MAX_MODEL_LENS[0])]["gain"],
        },
    }


def report(result: dict) -> list[str]:
    u, s, w = result["utilization"], result["settings"], result["workload"]
    peak, contiguous = u["peak"], u["contiguous_utilization"]
    lines = [
        f"(a) {w['requests']} requests (prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, outputs "
        f"{w['output_len'][0]}-{w['output_len'][1]} tokens) on a pool of {s['num_blocks']} blocks "
        f"x {s['block_size']} = {s['pool_tokens']} token slots; sampled after every scheduler "
        f"step. At the peak allocation {peak['running']} sequences held {peak['tokens']} tokens "
        f"in {peak['slots']} allocated slots ({u['preemptions']} preemptions in the run).",
        "",
        "| layout | KV slots holding a token |",
        "|---|---|",
        f"| paged (block size {s['block_size']}) | {u['slot_utilization']:.3f} |",
    ]
    lines += [
        f"| contiguous, max_model_len {n} per sequence | {v:.3f} |" for n, v in contiguous.items()
    ]
    lines += [
        "",
        f"(b) Sequences of the same length distribution ({w['concurrency_sequences']} offered) "
        f"resident at once in {s['pool_tokens']} token slots; paged measured on the engine "
        "(equal to block arithmetic, no preemption).",
        "",
        "| max_model_len | paged | contiguous preallocation | gain |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {n} | {c['paged']} | {c['contiguous']} | {c['gain']:.2f}x |"
        for n, c in result["concurrency"].items()
    ]
    value = result["summary"]["kv_slot_utilization"]
    return lines + [
        "",
        summary_line(
            "kv_slot_utilization", value, f">= {UTILIZATION_TARGET}", value >= UTILIZATION_TARGET
        ),
    ]


def plot(result: dict, out_dir: Path) -> list[Path]:
    return [_usage_plot(result, out_dir), _concurrency_plot(result, out_dir)]


def _usage_plot(result: dict, out_dir: Path) -> Path:
    series = result["utilization"]["series"]
    steps = range(len(series))
    fig, ax = plots.pyplot().subplots(figsize=(7, 4))
    ax.plot(steps, [s["slots"] for s in series], label="allocated KV slots")
    ax.plot(steps, [s["tokens"] for s in series], label="tokens held")
    ax.axhline(result["settings"]["pool_tokens"], color="gray", linestyle="--", label="pool size")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens")
    ax.set_title("KV usage over time (paged)")
    ax.legend()
    return plots.save(fig, out_dir / f"{NAME}_usage.png")


def _concurrency_plot(result: dict, out_dir: Path) -> Path:
    concurrency = result["concurrency"]
    fig, ax = plots.pyplot().subplots(figsize=(6, 4))
    x = range(len(concurrency))
    ax.bar([i - 0.2 for i in x], [c["paged"] for c in concurrency.values()], 0.4, label="paged")
    ax.bar(
        [i + 0.2 for i in x],
        [c["contiguous"] for c in concurrency.values()],
        0.4,
        label="contiguous preallocation",
    )
    ax.set_xticks(list(x), [f"max_model_len {n}" for n in concurrency])
    ax.set_ylabel("sequences resident at once")
    ax.set_ylim(0, 1.3 * max(c["paged"] for c in concurrency.values()))  # room for the legend
    ax.set_title(f"Concurrency in {result['settings']['pool_tokens']} KV slots")
    ax.legend()
    return plots.save(fig, out_dir / f"{NAME}_concurrency.png")


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
