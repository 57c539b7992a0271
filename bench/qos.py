"""Mixed traffic: interactive requests beside a batch flood, under fcfs, priority and fair share.

LLM: a flood of long batch requests from one tenant arrives at once; short interactive requests
(32 output tokens) from four other tenants arrive at a steady rate while it runs. Each mode is a
fresh engine with the same settings, driven in real time (requests enter at their arrival time,
TTFT is counted from it):

- alone: the interactive requests without the flood (the reference);
- fcfs: the flood and the interactive requests, first come first served (the contrast);
- priority: `scheduling_policy: priority`, interactive requests priority 0, the flood 1;
- fair_share: `fair_share: true`, no priorities (the flood is one tenant, each user another).

The interactive arrivals are spread over 60% of the time the flood alone takes (measured first,
which also warms up), so every one of them meets the flood. Reported per mode: interactive TTFT
p50 / p99, their queue wait (arrival to first scheduled) and the flood's output tokens per second
(its tokens over the time its last request took). Greedy tokens must be identical in every mode
(checked on every run) before any figure is kept. Modes run in an order rotating each repeat.

Embeddings (bench.qos_embedding): the same for a flood of large embedding requests against
single short texts, through the embedding service's micro-batch scheduler.

    python -m bench.qos [--quick] [--threads 1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli, plots
from bench.llm import check_same, greedy, new_engine
from bench.output import progress
from bench.qos_embedding import embedding_qos, embedding_report
from bench.skeleton import Benchmark
from bench.summary import summary_line, target_of
from bench.timing import p50_p99_ms, percentile, spread
from tooling.checkpoints import FULL, QUICK, Sizes, build_random_llama

NAME = "qos"
HEADING = "Mixed traffic: interactive requests beside a batch flood"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=1, repeats=1)
MODES = ("alone", "fcfs", "priority", "fair_share", "fcfs_large_steps", "priority_large_steps")
"""The last two run at the throughput-oriented token budget (`Traffic.large_step_tokens`)."""
KEYS = {
    "priority": "qos_interactive_ttft_p99_vs_alone",
    "fair_share": "qos_fair_share_interactive_ttft_p99_vs_alone",
    "fcfs": "qos_fcfs_interactive_ttft_p99_vs_alone",
    "priority_large_steps": "qos_large_steps_interactive_ttft_p99_vs_alone",
}
THROUGHPUT_KEYS = {
    "priority": ("qos_priority_batch_throughput_vs_fcfs", "fcfs"),
    "fair_share": ("qos_fair_share_batch_throughput_vs_fcfs", "fcfs"),
    "priority_large_steps": (
        "qos_large_steps_priority_batch_throughput_vs_fcfs",
        "fcfs_large_steps",
    ),
}
USERS = 4
ARRIVAL_WINDOW = 0.6
"""Interactive arrivals span this share of the flood's own duration."""


@dataclass(frozen=True)
class Traffic:
    model: Sizes
    batch_requests: int
    batch_prompt: tuple[int, int]
    batch_output: tuple[int, int]
    interactive_requests: int
    interactive_prompt: tuple[int, int]
    interactive_output: int
    max_num_seqs: int
    max_num_batched_tokens: int
    """The token budget of a step, sized for interactive latency: a request arriving waits for
    the step in flight, then its own."""
    large_step_tokens: int
    """The contrast: a throughput-oriented budget (longer steps)."""


PRESETS = {
    "quick": Traffic(QUICK, 16, (16, 48), (8, 16), 6, (4, 8), 8, 8, 32, 64),
    "cpu": Traffic(FULL, 256, (128, 384), (32, 96), 24, (8, 24), 32, 32, 64, 256),
    "cuda": Traffic(FULL, 256, (512, 1024), (64, 256), 64, (16, 64), 32, 128, 512, 2048),
}


@dataclass(frozen=True)
class Arrival:
    request_id: str
    at: float
    """Seconds after the run starts."""
    prompt: list[int]
    max_tokens: int
    tenant: str
    batch: bool


@dataclass
class ModeRun:
    outputs: dict[str, list[int]]
    ttft: list[float]
    """Interactive requests' seconds from arrival to first token."""
    queue_wait: list[float]
    """Interactive requests' seconds from arrival to first scheduled."""
    batch_seconds: float
    """From the start to the last batch request's finish (0 without the flood)."""
    batch_tokens: int
    steps: int
    step_seconds: float
    """Inside engine.step, summed."""
    seconds: float
    steps_interrupted: int
    """Steps that yielded to an arrival (`interruptible_steps`), counted in `steps`."""


def make_arrivals(traffic: Traffic, seed: int, interval: float) -> list[Arrival]:
    """The flood at 0 s, then one interactive request every `interval` seconds from 0.5 s."""
    rng = random.Random(seed)
    vocab = traffic.model.vocab

    def prompt(lengths: tuple[int, int]) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))]

    flood = [
        Arrival(
            f"batch-{k}",
            0.0,
            prompt(traffic.batch_prompt),
            rng.randint(*traffic.batch_output),
            "batch",
            True,
        )
        for k in range(traffic.batch_requests)
    ]
    interactive = [
        Arrival(
            f"user-{k}",
            0.5 + k * interval,
            prompt(traffic.interactive_prompt),
            traffic.interactive_output,
            f"user-{k % USERS}",
            False,
        )
        for k in range(traffic.interactive_requests)
    ]
    return flood + interactive


def mode_settings(traffic: Traffic, mode: str) -> dict:
    max_model_len = traffic.batch_prompt[1] + traffic.batch_output[1]
    large = mode.endswith("_large_steps")
    settings = {
        "max_model_len": max_model_len,
        "max_num_seqs": traffic.max_num_seqs,
        "max_num_batched_tokens": traffic.large_step_tokens
        if large
        else traffic.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "max_queue_size": traffic.batch_requests + traffic.interactive_requests,
    }
    policy = mode.removesuffix("_large_steps")
    if policy == "priority":
        settings["scheduling_policy"] = "priority"
    if policy == "fair_share":
        settings["fair_share"] = True
    return settings


def drive(engine, arrivals: list[Arrival], priorities: bool) -> ModeRun:
    """Feed `arrivals` to the engine at their times, stepping it in between; until all end."""
    from backend_lib.llm.core.request import EngineRequest

    pending = sorted(arrivals, key=lambda a: a.at)
    finals, steps, index, step_seconds = {}, 0, 0, 0.0
    start = time.monotonic()
    requests = [
        EngineRequest(
            a.request_id,
            None,
            greedy(a.max_tokens),
            a.prompt,
            arrival_time=start + a.at,
            priority=int(a.batch and priorities),
            tenant=a.tenant,
        )
        for a in pending
    ]

    def due() -> list[EngineRequest]:
        """Arrived and not added yet: what a serving loop's submissions are to a step in flight
        (`interruptible_steps`)."""
        now = time.monotonic()
        later = itertools.islice(requests, index, None)
        return list(itertools.takewhile(lambda r: r.arrival_time <= now, later))

    engine.interrupts.arrivals = due
    while index < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while index < len(pending) and pending[index].at <= now:
            engine.add(requests[index])
            index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[index].at - now))
            continue
        steps += 1
        stepped = time.monotonic()
        outputs = engine.step()
        step_seconds += time.monotonic() - stepped
        for output in outputs:
            if output.finished:
                if output.error is not None:
                    raise SystemExit(f"{output.request_id} failed: {output.error}")
                finals[output.request_id] = output
    seconds = time.monotonic() - start
    batch = [o for o in finals.values() if o.request_id.startswith("batch-")]
    users = [o.metrics for o in finals.values() if o.request_id.startswith("user-")]
    return ModeRun(
        outputs={rid: o.outputs[0].token_ids for rid, o in finals.items()},
        ttft=[m.first_token_time - m.arrival_time for m in users],
        queue_wait=[m.first_scheduled_time - m.arrival_time for m in users],
        batch_seconds=max((o.metrics.finished_time - start for o in batch), default=0.0),
        batch_tokens=sum(len(o.outputs[0].token_ids) for o in batch),
        steps=steps,
        step_seconds=step_seconds,
        seconds=seconds,
        steps_interrupted=engine.interrupts.count,
    )


def run_mode(
    model_dir: Path, device, dtype: str, traffic: Traffic, mode: str, arrivals: list[Arrival]
) -> ModeRun:
    engine = new_engine(model_dir, device, dtype, **mode_settings(traffic, mode))
    try:
        chosen = [a for a in arrivals if not (mode == "alone" and a.batch)]
        return drive(engine, chosen, priorities=mode.startswith("priority"))
    finally:
        engine.close()


def check_modes(runs: dict[str, ModeRun], dtype: str) -> dict:
    """Every mode's greedy tokens equal fcfs's, request by request (alone's: its requests)."""
    reference = runs["fcfs"].outputs
    checks = {}
    for name, run in runs.items():
        if name != "fcfs":
            ids = sorted(run.outputs)
            outputs = {name: [run.outputs[r] for r in ids]}
            checks[name] = check_same("fcfs", [reference[r] for r in ids], outputs, dtype)
    return checks


def run(args: argparse.Namespace, scratch: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    traffic = PRESETS[cli.mode(args.quick, device)]
    model_dir = scratch / "model"
    num_params = build_random_llama(traffic.model, model_dir, args.seed)
    progress(
        f"{NAME}: {num_params / 1e6:.1f}M parameters, {dtype} on {device}; flood of "
        f"{traffic.batch_requests} requests, {traffic.interactive_requests} interactive"
    )
    # The flood alone sets the interactive arrival rate (and warms up).
    flood_only = [a for a in make_arrivals(traffic, args.seed, 0.0) if a.batch]
    calibration = run_mode(model_dir, device, dtype, traffic, "fcfs", flood_only)
    interval = ARRIVAL_WINDOW * calibration.batch_seconds / traffic.interactive_requests
    arrivals = make_arrivals(traffic, args.seed, interval)
    progress(
        f"flood alone: {calibration.batch_seconds:.1f} s; an interactive request every "
        f"{interval:.2f} s"
    )
    runs: dict[str, list[ModeRun]] = {name: [] for name in MODES}
    fidelity = {}
    for rep in range(args.repeats):
        order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
        this = {}
        for name in order:
            this[name] = run_mode(model_dir, device, dtype, traffic, name, arrivals)
            progress(
                f"repeat {rep + 1}/{args.repeats} {name}: {this[name].seconds:.1f} s, "
                f"TTFT p99 {percentile(this[name].ttft, 99) * 1e3:.0f} ms"
            )
        fidelity[f"repeat_{rep + 1}"] = check_modes(this, dtype)
        for name in MODES:
            runs[name].append(this[name])
    llm = llm_figures(runs)
    encoders = embedding_qos(args, device)
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {**asdict(traffic.model), "parameters": num_params},
        "traffic": {
            **asdict(traffic),
            "model": None,
            "interactive_interval_s": interval,
            "flood_alone_s": calibration.batch_seconds,
            "users": USERS,
            "seed": args.seed,
        },
        "settings": {name: mode_settings(traffic, name) for name in MODES},
        "repeats": args.repeats,
        "llm": llm,
        "embedding": encoders["result"],
        "fidelity": fidelity,
        "summary": {**llm["summary"], **encoders["summary"]},
    }


def llm_figures(runs: dict[str, list[ModeRun]]) -> dict:
    """Per mode: TTFT and queue-wait p50/p99 (ms, over every repeat's interactive requests), batch
    tokens/s; the ratios of the summary (p99 over alone's p99; batch rate over fcfs's)."""
    ttft = {m: p50_p99_ms([t for r in rs for t in r.ttft]) for m, rs in runs.items()}
    wait = {m: p50_p99_ms([t for r in rs for t in r.queue_wait]) for m, rs in runs.items()}
    rate = {
        m: spread([r.batch_tokens / r.batch_seconds for r in rs])
        for m, rs in runs.items()
        if m != "alone"
    }
    step_ms = {
        m: statistics.median(r.step_seconds / r.steps * 1e3 for r in rs) for m, rs in runs.items()
    }
    interrupted = {m: sum(r.steps_interrupted for r in rs) for m, rs in runs.items()}
    summary = {key: ttft[m]["p99"] / ttft["alone"]["p99"] for m, key in KEYS.items()}
    summary |= {
        key: rate[m]["median"] / rate[base]["median"] for m, (key, base) in THROUGHPUT_KEYS.items()
    }
    return {
        "ttft_ms": ttft,
        "queue_wait_ms": wait,
        "batch_output_tokens_per_second": rate,
        "mean_step_ms": step_ms,
        "steps_interrupted": interrupted,
        "summary": summary,
    }


def report(result: dict) -> list[str]:
    t, llm = result["traffic"], result["llm"]
    lines = [
        f"{t['batch_requests']} batch requests (prompts {t['batch_prompt'][0]}-"
        f"{t['batch_prompt'][1]} tokens, outputs {t['batch_output'][0]}-{t['batch_output'][1]}) "
        f"at once from one tenant; {t['interactive_requests']} interactive requests (prompts "
        f"{t['interactive_prompt'][0]}-{t['interactive_prompt'][1]}, {t['interactive_output']} "
        f"output tokens) from {t['users']} other tenants, one every "
        f"{t['interactive_interval_s']:.2f} s. max_num_seqs {t['max_num_seqs']}, "
        f"max_num_batched_tokens {t['max_num_batched_tokens']} (*_large_steps: "
        f"{t['large_step_tokens']}), chunked prefill; "
        f"{result['dtype']} on {result['device']}, {result['repeats']} repeat(s) in rotating "
        "order; greedy tokens identical in every mode.",
        "",
        "| mode | interactive TTFT p50 / p99 (ms) | queue wait p50 / p99 (ms) | mean step (ms) "
        "| steps interrupted | batch output tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for m in MODES:
        ttft, wait = llm["ttft_ms"][m], llm["queue_wait_ms"][m]
        rate = llm["batch_output_tokens_per_second"].get(m)
        shown = "-" if rate is None else f"{rate['median']:.0f}"
        lines.append(
            f"| {m} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | {wait['p50']:.0f} / "
            f"{wait['p99']:.0f} | {llm['mean_step_ms'][m]:.1f} | "
            f"{llm.get('steps_interrupted', {}).get(m, 0)} | {shown} |"
        )
    lines.append("")
    for key, value in llm["summary"].items():
        goal = target_of(key)
        if goal is not None:
            lines.append("- " + summary_line(key, value, goal.text, goal.met(value)))
        else:
            lines.append(f"- `{key}`: {value:.3g} (for contrast)")
    return lines + ["", *embedding_report(result["embedding"])]


def plot(result: dict, out_dir: Path) -> list[Path]:
    fig, ax = plots.pyplot().subplots(figsize=(7, 4))
    ttft = result["llm"]["ttft_ms"]
    x = range(len(MODES))
    for offset, key in ((-0.2, "p50"), (0.2, "p99")):
        ax.bar([i + offset for i in x], [ttft[m][key] for m in MODES], 0.4, label=f"TTFT {key}")
    ax.set_xticks(list(x), MODES)
    ax.set_yscale("log")
    ax.set_ylabel("interactive TTFT (ms, log)")
    ax.set_title("Interactive requests beside a batch flood")
    ax.legend()
    return [plots.save(fig, out_dir / f"{NAME}_ttft.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
