"""Serving benchmark: the `llm` model under a real tritonserver against the same engine driven
directly in this process.

A random Llama checkpoint (tooling.checkpoints.build_random_llama, ~16M parameters on CPU) or
`--model PATH` is served by a tritonserver on a temporary repository holding only an `llm` model.
An asyncio load generator (bench.serving_load: tritonclient.grpc.aio, one decoupled `stream_infer`
per request) sends prompts of mixed lengths (token-word strings "w123 w45 ...", which the checkpoint's word-level tokenizer maps to
ids), greedy, EOS ignored, `max_tokens` per request:

- closed loop at each concurrency N: N clients, each sending its next request when the last one
  finished; the DIRECT engine (LLMEngine in this process, same checkpoint and config, a plain
  step loop on a worker thread as in the server) keeps the same N requests in flight on the
  same prompts;
- open loop: Poisson arrivals at a fixed rate (a share of the served capacity measured first).

Figures follow genai-perf: time to first token (TTFT), inter-token latency per request
(ITL = (e2e - TTFT) / (output tokens - 1)), end-to-end latency (p50/p99 over requests), output
tokens/s and requests/s over the run. Before timing, served greedy text must equal the direct
engine's. Both sides use the same torch thread count: `--threads N` sets it here and, through
OMP_NUM_THREADS, in the server's Python-backend process (the llm config has no threads setting).

    python -m bench.serving [--quick] [--threads 1] [--out bench/results/serving.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import cli, plots
from bench.output import progress
from bench.server import instance_kind, tritonserver
from bench.serving_load import (
    Run,
    direct_closed_loop,
    make_prompts,
    served_closed_loop,
    served_poisson,
)
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import spread
from tooling.checkpoints import Sizes, build_random_llama

NAME = "serving"
HEADING = "Serving: tritonserver llm model vs the direct engine"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=3)
TARGET_SERVED_VS_DIRECT = target("served_vs_direct")


@dataclass(frozen=True)
class Preset:
    model: Sizes
    concurrencies: tuple[int, ...]
    prompt_len: tuple[int, int]
    max_tokens: int
    requests_per_client: int
    """Closed loop: requests per run = max(min_requests, concurrency * requests_per_client)."""
    min_requests: int
    poisson_requests: int
    max_model_len: int


# Sizes(hidden, intermediate, layers, heads, kv_heads, vocab): the model only; the workload is here.
PRESETS = {
    "quick": Preset(
        Sizes(64, 128, 2, 4, 2, 512),
        concurrencies=(1, 4),
        prompt_len=(4, 32),
        max_tokens=8,
        requests_per_client=2,
        min_requests=4,
        poisson_requests=8,
        max_model_len=256,
    ),
    "cpu": Preset(
        Sizes(384, 1024, 6, 4, 2, 8192),
        concurrencies=(1, 4, 16),
        prompt_len=(16, 256),
        max_tokens=32,
        requests_per_client=3,
        min_requests=8,
        poisson_requests=32,
        max_model_len=1024,
    ),
    "cuda": Preset(
        Sizes(1024, 2816, 16, 16, 4, 16384),
        concurrencies=(1, 16, 64),
        prompt_len=(64, 1024),
        max_tokens=128,
        requests_per_client=3,
        min_requests=8,
        poisson_requests=128,
        max_model_len=2048,
    ),
}
POISSON_LOAD = 0.6
"""The open-loop rate as a share of the served requests/s at the highest concurrency."""


# --- the benchmark -------------------------------------------------------------------------------


def engine_parameters(model_dir: Path, dtype: str, preset: Preset) -> dict[str, str]:
    """The llm model's config.pbtxt parameters; the direct engine is built from the same dict.
    An explicit KV pool size (num_blocks) keeps both engines alike and lets them share a GPU."""
    longest = preset.prompt_len[1] + preset.max_tokens
    blocks_per_request = -(-longest // 16) + 1
    most_in_flight = max(max(preset.concurrencies), 64)
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": str(preset.max_model_len),
        "max_num_seqs": str(most_in_flight),
        "max_num_batched_tokens": str(max(2048, preset.max_model_len)),
        "num_blocks": str(blocks_per_request * most_in_flight),
        "max_queue_size": "4096",
    }


def check_fidelity(url: str, engine, prompts: list[str], max_tokens: int) -> dict:
    """Served greedy text must equal the direct engine's (this also warms both up). One request
    at a time, so both engines run the very same steps (16-bit rounding depends on the batch)."""
    served = [t.text for t in served_closed_loop(url, prompts, max_tokens, 1)]
    direct = [t.text for t in direct_closed_loop(engine, prompts, max_tokens, 1)]
    same = sum(a == b for a, b in zip(served, direct, strict=True))
    progress(f"fidelity: {same}/{len(prompts)} served texts equal the direct engine's")
    if same != len(prompts):
        first = next(i for i in range(len(prompts)) if served[i] != direct[i])
        raise SystemExit(
            f"served greedy text differs from the direct engine's on prompt {first}:"
            f"\n served: {served[first][:200]!r}\n direct: {direct[first][:200]!r}"
        )
    return {"prompts": len(prompts), "max_tokens": max_tokens, "identical": same, "passed": True}


def run(args: argparse.Namespace, scratch: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    if args.model:
        model_dir = Path(args.model).resolve()
        model = {"dir": str(model_dir), "parameters": None}
    else:
        model_dir = scratch / "checkpoint"
        num_params = build_random_llama(preset.model, model_dir, args.seed)
        model = {"random_llama": asdict(preset.model), "parameters": num_params}
    return run_with(args, preset, model_dir, model, device, dtype, scratch / "repo")


def run_with(
    args: argparse.Namespace,
    preset: Preset,
    model_dir: Path,
    model: dict,
    device,
    dtype: str,
    repository: Path,
) -> dict:
    import torch

    from backend_lib.config import from_parameters
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.engine.llm_engine import LLMEngine
    from tooling.repository import ModelSpec, write_model

    parameters = engine_parameters(model_dir, dtype, preset)
    spec = ModelSpec(
        "llm", "llm", parameters, max_batch_size=0, instance_kind=instance_kind(device)
    )
    write_model(spec, repository)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    progress(
        f"model {model['parameters'] or '?'} parameters, {dtype} on {device}; starting tritonserver"
    )
    with tritonserver(repository, args.threads) as (server, server_start_s):
        engine = LLMEngine.from_config(from_parameters(LLMConfig, parameters), model_dir, device)
        systems = Systems(server.grpc_url, engine, preset, vocab, args.seed)
        fidelity = check_fidelity(
            systems.url, engine, systems.prompts(4, "check"), preset.max_tokens
        )
        runs, poisson_rate = [], None
        for repeat in range(args.repeats):
            runs += systems.closed_loop(repeat, args.repeats)
            if poisson_rate is None:
                top = next(r for r in reversed(runs) if r.system == "served")
                poisson_rate = POISSON_LOAD * top.metrics()["requests_per_s"]
            runs.append(systems.poisson(repeat, args.repeats, poisson_rate))
    for run_ in runs:
        if any(r.output_tokens != preset.max_tokens for r in run_.requests):
            raise SystemExit(
                f"a {run_.system} request produced other than {preset.max_tokens} tokens"
            )
    return build_result(
        args,
        preset,
        runs,
        model,
        device,
        dtype,
        fidelity,
        server_start_s,
        poisson_rate,
        parameters,
        torch.get_num_threads(),
    )


@dataclass
class Systems:
    """The served model and the direct engine under the preset's loads."""

    url: str
    """tritonserver's gRPC address."""
    engine: object
    preset: Preset
    vocab: int
    seed: int

    def prompts(self, count: int, key: str) -> list[str]:
        return make_prompts(count, self.preset.prompt_len, self.vocab, f"{self.seed}-{key}")

    def closed_loop(self, repeat: int, repeats: int) -> list[Run]:
        """Both systems at each concurrency, on the same prompts, in alternating order."""
        runs, max_tokens = [], self.preset.max_tokens
        for concurrency in self.preset.concurrencies:
            count = max(self.preset.min_requests, concurrency * self.preset.requests_per_client)
            prompts = self.prompts(count, f"{repeat}-c{concurrency}")
            systems = {
                "served": lambda p=prompts, c=concurrency: served_closed_loop(
                    self.url, p, max_tokens, c
                ),
                "direct": lambda p=prompts, c=concurrency: direct_closed_loop(
                    self.engine, p, max_tokens, c
                ),
            }
            for name in list(systems)[::-1] if repeat % 2 else list(systems):
                runs.append(Run(name, "closed", concurrency, None, repeat, systems[name]()))
                progress(
                    f"repeat {repeat + 1}/{repeats} {name} concurrency {concurrency}:"
                    f" {runs[-1].metrics()['output_tokens_per_s']:.1f} output tokens/s"
                )
        return runs

    def poisson(self, repeat: int, repeats: int, rate: float) -> Run:
        """The served model under Poisson arrivals at `rate` requests/s."""
        key = f"{self.seed}-{repeat}-poisson"
        prompts = self.prompts(self.preset.poisson_requests, f"{repeat}-poisson")
        requests = served_poisson(self.url, prompts, self.preset.max_tokens, rate, key)
        run_ = Run("served", "poisson", None, rate, repeat, requests)
        progress(
            f"repeat {repeat + 1}/{repeats} served poisson {rate:.2f}/s: "
            f"{run_.metrics()['output_tokens_per_s']:.1f} output tokens/s"
        )
        return run_


def build_result(
    args,
    preset: Preset,
    runs: list[Run],
    model: dict,
    device,
    dtype: str,
    fidelity: dict,
    server_start_s: float,
    poisson_rate: float,
    parameters: dict[str, str],
    direct_threads: int,
) -> dict:
    throughput: dict[str, dict[str, dict[str, float]]] = {"served": {}, "direct": {}}
    for system in throughput:
        for concurrency in preset.concurrencies:
            rates = [
                r.metrics()["output_tokens_per_s"]
                for r in runs
                if r.system == system and r.concurrency == concurrency
            ]
            throughput[system][str(concurrency)] = spread(rates)
    top = max(preset.concurrencies)
    by_repeat = {
        (r.system, r.repeat): r.metrics()["output_tokens_per_s"]
        for r in runs
        if r.concurrency == top
    }
    ratios = [by_repeat[("served", k)] / by_repeat[("direct", k)] for k in range(args.repeats)]
    same_text = [
        a.text == b.text
        for served in runs
        if served.system == "served" and served.load == "closed"
        for direct in runs
        if direct.system == "direct"
        and (direct.concurrency, direct.repeat) == (served.concurrency, served.repeat)
        for a, b in zip(served.requests, direct.requests, strict=True)
    ]
    return {
        "device": str(device),
        "dtype": dtype,
        "model": model,
        "workload": {
            "prompt_len": list(preset.prompt_len),
            "max_tokens": preset.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "concurrencies": list(preset.concurrencies),
            "requests_per_run": {
                str(c): max(preset.min_requests, c * preset.requests_per_client)
                for c in preset.concurrencies
            },
            "poisson_requests": preset.poisson_requests,
            "poisson_rate_per_s": poisson_rate,
            "poisson_load": POISSON_LOAD,
            "seed": args.seed,
        },
        "settings": {
            "llm_parameters": parameters,
            "client": "tritonclient.grpc.aio stream_infer",
            "threads": {
                "direct": direct_threads,
                "server": args.threads or "torch default (same as direct)",
            },
        },
        "repeats": args.repeats,
        "server_start_s": server_start_s,
        "fidelity": fidelity,
        "served_direct_same_text": sum(same_text) / len(same_text),
        "output_tokens_per_second": throughput,
        "served_vs_direct_per_repeat": ratios,
        "runs": [r.record() for r in runs],
        "summary": {"served_vs_direct": statistics.median(ratios)},
    }


# --- report and plots ----------------------------------------------------------------------------


def _median_metrics(result: dict, system: str, load: str, concurrency: int | None) -> dict:
    runs = [
        r["metrics"]
        for r in result["runs"]
        if (r["system"], r["load"]) == (system, load) and r["concurrency"] == concurrency
    ]
    keys = runs[0].keys()
    return {
        k: (statistics.median(v) if (v := [m[k] for m in runs if m[k] is not None]) else None)
        for k in keys
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _model_text(model: dict) -> str:
    if "dir" in model:
        return f"checkpoint {model['dir']}"
    return f"{model['parameters'] / 1e6:.1f}M-parameter random Llama"


def report(result: dict) -> list[str]:
    workload, ratio = result["workload"], result["summary"]["served_vs_direct"]
    top = max(workload["concurrencies"])
    lines = [
        f"{_model_text(result['model'])} ({result['dtype']}, {result['device']}), prompts of {workload['prompt_len'][0]}-{workload['prompt_len'][1]} "
        f"tokens, {workload['max_tokens']} output tokens each (greedy, EOS ignored). Served: "
        "asyncio gRPC streaming clients against tritonserver; direct: LLMEngine's step loop in "
        "the client's process with the same config and the same requests in flight. Closed loop "
        f"at each concurrency; open loop with Poisson arrivals at {workload['poisson_rate_per_s']:.2f}"
        f" requests/s ({workload['poisson_load']:.0%} of served capacity). Medians over "
        f"{result['repeats']} repeats; TTFT, ITL (per request) and e2e percentiles over requests. "
        f"Threads: {result['settings']['threads']}. Served greedy text equals the direct engine's "
        f"(checked on {result['fidelity']['prompts']} prompts before timing; "
        f"{result['served_direct_same_text']:.0%} of timed requests identical).",
        "",
        "| system | load | output tok/s (min-max) | req/s | TTFT p50/p99 ms | ITL p50/p99 ms "
        "| e2e p50/p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    loads = [(s, "closed", c) for c in workload["concurrencies"] for s in ("served", "direct")]
    for system, load, concurrency in [*loads, ("served", "poisson", None)]:
        m = _median_metrics(result, system, load, concurrency)
        label = (
            f"concurrency {concurrency}"
            if concurrency
            else f"Poisson {workload['poisson_rate_per_s']:.2f}/s"
        )
        rates = result["output_tokens_per_second"][system].get(str(concurrency))
        spread_text = f" ({rates['min']:.0f}-{rates['max']:.0f})" if rates else ""
        lines.append(
            f"| {system} | {label} | {m['output_tokens_per_s']:.1f}{spread_text} | "
            f"{m['requests_per_s']:.2f} | {_ms(m['ttft_p50_s'])} / {_ms(m['ttft_p99_s'])} | "
            f"{_ms(m['itl_p50_s'])} / {_ms(m['itl_p99_s'])} | {_ms(m['e2e_p50_s'])} / "
            f"{_ms(m['e2e_p99_s'])} |"
        )
    met = "met" if ratio >= TARGET_SERVED_VS_DIRECT else "NOT met"
    lines += [
        "",
        f"Target: served output tokens/s >= {TARGET_SERVED_VS_DIRECT} x direct at "
        f"concurrency {top}: {ratio:.2f} ({met}).",
        "",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    return [_throughput_plot(result, out_dir), _latency_plot(result, out_dir)]


def _throughput_plot(result: dict, out_dir: Path) -> Path:
    concurrencies = result["workload"]["concurrencies"]
    fig, ax = plots.pyplot().subplots(figsize=(5, 3.5))
    for system, style in (("served", "o-"), ("direct", "s--")):
        medians, errors = plots.medians_and_errors(
            result["output_tokens_per_second"][system][str(c)] for c in concurrencies
        )
        ax.errorbar(concurrencies, medians, yerr=errors, fmt=style, capsize=3, label=system)
    ax.set(
        xscale="log",
        xlabel="concurrency (closed loop)",
        ylabel="output tokens/s",
        title="Served vs direct throughput",
    )
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend()
    return plots.save(fig, out_dir / f"{NAME}_throughput.png")


def _latency_plot(result: dict, out_dir: Path) -> Path:
    concurrencies = result["workload"]["concurrencies"]
    fig, axes = plots.pyplot().subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in (
        (axes[0], "ttft_s", "time to first token"),
        (axes[1], "itl_s", "inter-token latency"),
    ):
        for color, c in enumerate(concurrencies):
            for system, style in (("served", "-"), ("direct", "--")):
                values = [
                    v * 1000
                    for r in result["runs"]
                    if r["system"] == system and r["concurrency"] == c
                    for v in r["per_request"][key]
                ]
                if values:
                    ax.plot(*plots.cdf(values), style, color=f"C{color}", label=f"{system} c={c}")
        ax.set(xlabel="ms", ylabel="share of requests", title=f"{title} (CDF)", xscale="log")
    axes[1].legend(fontsize=7)
    return plots.save(fig, out_dir / f"{NAME}_latency_cdf.png")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="serve this checkpoint directory instead of a random one"
    )


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot, add_args)

if __name__ == "__main__":
    BENCHMARK.main()
