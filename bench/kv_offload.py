"""The prefix cache's offload tier on a multi-turn agent workload: tier on vs off.

16 conversations share a long system prompt; each turn appends a tool result or user message to
its own history and asks for a short answer, which joins the history too. Agents run as a closed
loop: 4 turns in flight at a time, the next conversation's turn sent as soon as one finishes,
conversations in turn order (a conversation comes back after the other 15 had a turn). The
working set (every conversation's history) is about 4x the KV pool, so without the tier a
returning conversation finds only the system prompt cached and recomputes its history; with
`kv_offloading_backend: native` (host memory sized for the working set) the history comes back
from the tier. Modes run on fresh engines, alternating order every repeat; greedy outputs must be
identical in both before any figure is kept. TTFT is the engine's (arrival to first token);
throughput is output tokens over the run's wall time; the cached tokens each request reports
are checked against the prompt tokens the runner actually skipped.

    python -m bench.kv_offload [--quick] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli
from bench.llm import check_same, greedy, new_engine, time_to_first_token
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import summary_line, target_of
from bench.timing import p50_p99_ms, spread
from tooling.checkpoints import Sizes, build_random_llama

NAME = "kv_offload"
HEADING = "KV offload tier: a multi-turn agent workload, tier on vs off"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=3)
TTFT_TARGET = target_of("kv_offload_ttft_p50_ratio")
THROUGHPUT_TARGET = target_of("kv_offload_throughput_ratio")
MODES = ("tier_off", "tier_on")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Preset:
    sizes: Sizes
    system_len: int
    """Tokens of the system prompt every conversation starts with."""
    conversations: int
    turns: int
    message_len: int
    """Tokens each turn appends before the answer (a tool result, a user message)."""
    answer_len: int
    in_flight: int
    """Turns running at once (the agents' concurrency)."""


def model_sizes(hidden: int, layers: int, vocab: int) -> Sizes:
    return Sizes(
        hidden=hidden,
        intermediate=3 * hidden,
        layers=layers,
        heads=4,
        kv_heads=2,
        vocab=vocab,
        requests=1,
        prompt_len=(1, 1),
        output_len=(1, 1),
        static_batch=1,
    )


PRESETS = {
    "quick": Preset(model_sizes(128, 2, 1024), 128, 6, 4, 32, 4, 2),
    "cpu": Preset(model_sizes(256, 6, 8192), 512, 16, 8, 64, 8, 2),
    "cuda": Preset(model_sizes(1024, 12, 32000), 1024, 16, 6, 192, 16, 4),
}


def working_set_blocks(preset: Preset) -> int:
    """Blocks of every conversation's full history (the system prompt's once)."""
    history = preset.turns * (preset.message_len + preset.answer_len)
    return -(-preset.system_len // BLOCK_SIZE) + preset.conversations * -(-history // BLOCK_SIZE)


def max_len(preset: Preset) -> int:
    return preset.system_len + preset.turns * (preset.message_len + preset.answer_len)


def messages(preset: Preset, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and, per conversation, its turns' messages."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, preset.sizes.vocab) for _ in range(n)]

    system = tokens(preset.system_len)
    turns = [
        [tokens(preset.message_len) for _ in range(preset.turns)]
        for _ in range(preset.conversations)
    ]
    return system, turns


def run_agents(engine, preset: Preset, system: list[int], turns: list[list[list[int]]]) -> dict:
    """The closed loop of the module docstring on `engine`: outputs, TTFTs, the run's seconds,
    and per request the cached tokens reported and the prompt tokens computed."""
    histories = [list(system) for _ in turns]
    order = [(c, t) for t in range(preset.turns) for c in range(preset.conversations)]
    computed = _count_prompt_tokens_computed(engine)
    outputs: dict[tuple[int, int], list[int]] = {}
    ttfts, cached, prompt_lens, in_flight = [], [], {}, {}
    start = time.perf_counter()
    while order or in_flight:
        while order and len(in_flight) < preset.in_flight:
            conversation, turn = order.pop(0)
            prompt = histories[conversation] + turns[conversation][turn]
            request_id = f"c{conversation}-t{turn}"
            engine.add_request(request_id, None, greedy(preset.answer_len), prompt_token_ids=prompt)
            in_flight[request_id] = (conversation, turn, prompt)
            prompt_lens[request_id] = len(prompt)
        for output in engine.step():
            if not output.finished:
                continue
            conversation, turn, prompt = in_flight.pop(output.request_id)
            answer = output.outputs[0].token_ids
            histories[conversation] = prompt + answer
            outputs[conversation, turn] = answer
            ttfts.append(time_to_first_token(output))
            cached.append((output.request_id, output.num_cached_tokens))
    seconds = time.perf_counter() - start
    skipped_ok = all(prompt_lens[rid] - computed[rid] == n for rid, n in cached)
    stats = engine.stats()
    tier = stats.kv_offload
    return {
        "outputs": [outputs[key] for key in sorted(outputs)],
        "ttft": ttfts,
        "seconds": seconds,
        "output_tokens": len(outputs) * preset.answer_len,
        "cached_tokens": sum(n for _, n in cached),
        "cached_equals_skipped": skipped_ok,
        "tier_hits_tokens": 0 if tier is None else tier.external_hits,
        "pool_hit_tokens": stats.counters.prefix_cache_hits,
        "tier_copy_seconds": 0.0 if tier is None else tier.copy_seconds,
    }


def _count_prompt_tokens_computed(engine) -> dict[str, int]:
    """Request id -> prompt tokens the runner computed for it (filled as the engine steps)."""
    computed: dict[str, int] = {}
    execute = engine.runner.execute

    def counting(out, *args):
        for item in out.scheduled:
            seq = item.seq
            prompt_part = max(
                0, min(seq.num_prompt_tokens - item.start_position, item.num_new_tokens)
            )
            computed[seq.request_id] = computed.get(seq.request_id, 0) + prompt_part
        return execute(out, *args)

    engine.runner.execute = counting
    return computed


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    num_params = build_random_llama(
        preset.sizes, model_dir, args.seed, max_positions=max_len(preset)
    )
    working_set = working_set_blocks(preset)
    pool = max(working_set // 4, -(-max_len(preset) // BLOCK_SIZE) + 8)
    settings = {
        "max_model_len": max_len(preset),
        "block_size": BLOCK_SIZE,
        "num_blocks": pool,
        "max_num_seqs": preset.in_flight,
        "max_num_batched_tokens": 2048,
    }
    system, turns = messages(preset, args.seed)
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}; {preset.conversations} "
        f"conversations x {preset.turns} turns, working set {working_set} blocks, pool {pool}"
    )

    def mode(name: str) -> dict:
        tier = {}
        if name == "tier_on":
            engine = new_engine(model_dir, device, dtype, **settings)
            block_bytes = engine.runner.kv_spec.bytes_per_block
            engine.close()
            tier = {
                "kv_offloading_backend": "native",
                "kv_offloading_size": 2 * working_set * block_bytes / (1 << 30),
            }
        engine = new_engine(model_dir, device, dtype, **settings, **tier)
        try:
            return run_agents(engine, preset, system, turns)
        finally:
            engine.close()

    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    fidelity = {}
    for rep in range(args.repeats):
        for name in MODES if rep % 2 == 0 else MODES[::-1]:
            runs[name].append(mode(name))
            progress(
                f"repeat {rep + 1}/{args.repeats} {name}: median TTFT "
                f"{statistics.median(runs[name][-1]['ttft']) * 1e3:.1f} ms, "
                f"{runs[name][-1]['seconds']:.1f} s"
            )
        fidelity[f"repeat_{rep + 1}"] = check_same(
            "tier_off",
            runs["tier_off"][-1]["outputs"],
            {"tier_on": runs["tier_on"][-1]["outputs"]},
            dtype,
        )
    ttft_ratios = [
        statistics.median(off["ttft"]) / statistics.median(on["ttft"])
        for off, on in zip(runs["tier_off"], runs["tier_on"], strict=True)
    ]
    throughput_ratios = [
        (on["output_tokens"] / on["seconds"]) / (off["output_tokens"] / off["seconds"])
        for off, on in zip(runs["tier_off"], runs["tier_on"], strict=True)
    ]
    ttft = {name: [t for r in runs[name] for t in r["ttft"]] for name in MODES}
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(preset.sizes), "parameters": num_params},
        "workload": {
            "system_len": preset.system_len,
            "conversations": preset.conversations,
            "turns": preset.turns,
            "message_len": preset.message_len,
            "answer_len": preset.answer_len,
            "in_flight": preset.in_flight,
            "working_set_blocks": working_set,
            "pool_blocks": pool,
            "seed": args.seed,
        },
        "settings": {"engine": settings, "torch_threads": args.threads},
        "repeats": args.repeats,
        "ttft_seconds": ttft,
        "ttft_ms": {name: p50_p99_ms(v) for name, v in ttft.items()},
        "seconds": {name: [r["seconds"] for r in runs[name]] for name in MODES},
        "cached_tokens": {name: [r["cached_tokens"] for r in runs[name]] for name in MODES},
        "tier_hit_tokens": [r["tier_hits_tokens"] for r in runs["tier_on"]],
        "tier_copy_seconds": [r["tier_copy_seconds"] for r in runs["tier_on"]],
        "cached_equals_skipped": all(
            r["cached_equals_skipped"] for rs in runs.values() for r in rs
        ),
        "ttft_ratio": spread(ttft_ratios),
        "throughput_ratio": spread(throughput_ratios),
        "fidelity": fidelity,
        "summary": {
            "kv_offload_ttft_p50_ratio": statistics.median(ttft_ratios),
            "kv_offload_throughput_ratio": statistics.median(throughput_ratios),
        },
    }


def report(result: dict) -> list[str]:
    w, ms = result["workload"], result["ttft_ms"]
    summary = result["summary"]
    ttft_ratio, throughput_ratio = (
        summary["kv_offload_ttft_p50_ratio"],
        summary["kv_offload_throughput_ratio"],
    )
    lines = [
        f"{w['conversations']} conversations share a {w['system_len']}-token system prompt; each "
        f"of {w['turns']} turns appends {w['message_len']} tokens and asks for {w['answer_len']}, "
        f"{w['in_flight']} turns in flight (closed loop). Working set {w['working_set_blocks']} "
        f"blocks of {BLOCK_SIZE}, pool {w['pool_blocks']}. {result['repeats']} repeat(s) per mode, "
        f"fresh engines, alternating order, {result['dtype']} on {result['device']}; greedy "
        "outputs identical on and off.",
        "",
        "| offload tier | TTFT p50 (ms) | TTFT p99 (ms) | run (s, median) | cached tokens |",
        "|---|---|---|---|---|",
    ]
    for name in MODES:
        lines.append(
            f"| {name.removeprefix('tier_')} | {ms[name]['p50']:.1f} | {ms[name]['p99']:.1f} | "
            f"{statistics.median(result['seconds'][name]):.2f} | "
            f"{statistics.median(result['cached_tokens'][name])} |"
        )
    lines += [
        "",
        f"Tier hits: {statistics.median(result['tier_hit_tokens'])} tokens per run; the step "
        f"spent {statistics.median(result['tier_copy_seconds']) * 1e3:.1f} ms per run on tier "
        "copies. Cached tokens as reported equal the prompt tokens the runner skipped: "
        f"{result['cached_equals_skipped']}.",
        summary_line(
            "kv_offload_ttft_p50_ratio",
            ttft_ratio,
            TTFT_TARGET.text,
            TTFT_TARGET.met(ttft_ratio),
        ),
        summary_line(
            "kv_offload_throughput_ratio",
            throughput_ratio,
            THROUGHPUT_TARGET.text,
            THROUGHPUT_TARGET.met(throughput_ratio),
        ),
    ]
    return lines


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report)

if __name__ == "__main__":
    BENCHMARK.main()
