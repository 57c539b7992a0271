#!/usr/bin/env python3
"""Serving benchmark: the `llm` model under a real tritonserver against the same engine driven
directly in this process.

A random Llama checkpoint (bench_engine.build_checkpoint, ~16M parameters on CPU) or `--model PATH`
is served by a tritonserver on a temporary repository holding only an `llm` model. An asyncio load
generator (tritonclient.grpc.aio, one decoupled `stream_infer` per request) sends prompts of mixed
lengths (token-word strings "w123 w45 ...", which the checkpoint's word-level tokenizer maps to
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

    python scripts/bench_serving.py [--quick] [--threads 1] [--out bench/results/serving.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_main, machine_info, percentile, progress, spread  # noqa: E402
from bench_engine import Sizes, build_checkpoint  # noqa: E402

T = TypeVar("T")
NAME = "serving"
TARGET_SERVED_VS_DIRECT = 0.9


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


def _model(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> Sizes:
    # Only the model fields of bench_engine.Sizes matter here; the workload is this script's.
    return Sizes(
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        requests=0,
        prompt_len=(0, 0),
        output_len=(0, 0),
        static_batch=1,
    )


PRESETS = {
    "quick": Preset(
        _model(64, 128, 2, 4, 2, 512),
        concurrencies=(1, 4),
        prompt_len=(4, 32),
        max_tokens=8,
        requests_per_client=2,
        min_requests=4,
        poisson_requests=8,
        max_model_len=256,
    ),
    "cpu": Preset(
        _model(384, 1024, 6, 4, 2, 8192),
        concurrencies=(1, 4, 16),
        prompt_len=(16, 256),
        max_tokens=32,
        requests_per_client=3,
        min_requests=8,
        poisson_requests=32,
        max_model_len=1024,
    ),
    "cuda": Preset(
        _model(1024, 2816, 16, 16, 4, 16384),
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


# --- workload and per-request figures ------------------------------------------------------------


def make_prompts(count: int, prompt_len: tuple[int, int], vocab: int, key: str) -> list[str]:
    """`count` prompts of seeded random length, each word one token of the word-level tokenizer."""
    rng = random.Random(key)
    return [
        " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(*prompt_len)))
        for _ in range(count)
    ]


@dataclass
class RequestTiming:
    """perf_counter seconds of one request, and what it produced."""

    sent: float
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    text: str = ""

    def on_tokens(self, count: int, now: float) -> None:
        if count and self.first_token is None:
            self.first_token = now
        self.output_tokens += count


@dataclass
class Run:
    """One timed run of one system under one load."""

    system: str
    """served or direct."""
    load: str
    """closed (fixed concurrency) or poisson."""
    concurrency: int | None
    rate: float | None
    repeat: int
    requests: list[RequestTiming] = field(default_factory=list)

    def per_request(self) -> dict[str, list[float]]:
        ttft = [r.first_token - r.sent for r in self.requests]
        e2e = [r.end - r.sent for r in self.requests]
        itl = [
            (e - t) / (r.output_tokens - 1)
            for r, t, e in zip(self.requests, ttft, e2e, strict=True)
            if r.output_tokens > 1
        ]
        return {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e}

    def metrics(self) -> dict[str, float | None]:
        values = self.per_request()
        seconds = max(r.end for r in self.requests) - min(r.sent for r in self.requests)
        out: dict[str, float | None] = {
            "seconds": seconds,
            "output_tokens_per_s": sum(r.output_tokens for r in self.requests) / seconds,
            "requests_per_s": len(self.requests) / seconds,
        }
        for name, series in values.items():
            for q in (50, 99):
                out[f"{name.removesuffix('_s')}_p{q}_s"] = percentile(series, q) if series else None
        return out

    def record(self) -> dict:
        return {
            "system": self.system,
            "load": self.load,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "repeat": self.repeat,
            "metrics": self.metrics(),
            "per_request": self.per_request(),
        }


# --- served: asyncio gRPC streaming clients ------------------------------------------------------


def _llm_inputs(prompt: str, max_tokens: int) -> list:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value, datatype: str):
        item = grpcclient.InferInput(name, [1], datatype)
        item.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        return item

    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return [
        tensor("text_input", prompt.encode(), "BYTES"),
        tensor("stream", True, "BOOL"),
        tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"),
        tensor("exclude_input_in_output", True, "BOOL"),
        tensor("return_num_output_tokens", True, "BOOL"),
    ]


async def served_request(client, prompt: str, max_tokens: int) -> RequestTiming:
    """One streamed request; token counts come from the server's num_output_tokens."""
    inputs = _llm_inputs(prompt, max_tokens)

    async def one_request():
        yield {"model_name": "llm", "inputs": inputs}

    timing = RequestTiming(time.perf_counter())
    pieces = []
    async for result, error in client.stream_infer(one_request()):
        now = time.perf_counter()
        if error is not None:
            raise RuntimeError(f"served request failed: {error}")
        pieces.append(b"".join(result.as_numpy("text_output")).decode())
        timing.on_tokens(int(result.as_numpy("num_output_tokens").sum()), now)
        if result.get_response().parameters["triton_final_response"].bool_param:
            timing.end = now
    timing.text = "".join(pieces)
    if timing.end is None:
        raise RuntimeError("the response stream ended without a final response")
    return timing


async def _closed_loop(
    url: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    results: list[RequestTiming | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def client_loop() -> None:
        for i in next_index:  # shared iterator: each client takes the next prompt when free
            results[i] = await served_request(client, prompts[i], max_tokens)

    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        await client.close()
    return results


async def _poisson(
    url: str, prompts: list[str], max_tokens: int, rate: float, key: str
) -> list[RequestTiming]:
    import tritonclient.grpc.aio as aioclient

    rng = random.Random(key)
    client = aioclient.InferenceServerClient(url)
    start, arrival, tasks = time.perf_counter(), 0.0, []
    try:
        for prompt in prompts:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(served_request(client, prompt, max_tokens)))
            arrival += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


def served_closed_loop(
    url: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    return asyncio.run(_closed_loop(url, prompts, max_tokens, concurrency))


def served_poisson(
    url: str, prompts: list[str], max_tokens: int, rate: float, key: str
) -> list[RequestTiming]:
    return asyncio.run(_poisson(url, prompts, max_tokens, rate, key))


# --- direct: the engine's step loop in this process ----------------------------------------------


def on_worker_thread(function: Callable[[], T]) -> T:
    """Run `function` on a new thread and return its result.

    The server steps its engine on a background thread (EngineLoop), and torch's CPU parallelism
    is not the same there as on a process's main thread (measured at 2 threads: ~2 busy CPUs on
    the main thread, ~1.2 on another), so the direct engine runs on a thread of its own too.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # re-raised in the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="direct-engine")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def direct_closed_loop(
    engine, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    """Keep `concurrency` requests in the engine, adding the next one as each finishes (on a
    worker thread, as the server runs its engine)."""
    return on_worker_thread(lambda: _direct_closed_loop(engine, prompts, max_tokens, concurrency))


def _direct_closed_loop(
    engine, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    from backend_lib.llm.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results: dict[str, RequestTiming] = {}
    order: list[str] = []
    waiting = iter(prompts)

    def submit_next() -> None:
        prompt = next(waiting, None)
        if prompt is not None:
            request_id = f"direct-{time.perf_counter_ns()}-{len(order)}"
            results[request_id] = RequestTiming(time.perf_counter())
            order.append(request_id)
            engine.add_request(request_id, prompt, params)

    for _ in range(concurrency):
        submit_next()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timing = results[out.request_id]
            completion = out.outputs[0]
            timing.on_tokens(len(completion.token_ids) - timing.output_tokens, now)
            if out.finished:
                timing.end, timing.text = now, completion.text
                submit_next()
    return [results[r] for r in order]


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


def run(args: argparse.Namespace) -> dict:
    import torch

    from backend_lib.device import resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    preset = PRESETS["quick" if args.quick else "cuda" if device.type == "cuda" else "cpu"]
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        if args.model:
            model_dir = Path(args.model).resolve()
            model = {"dir": str(model_dir), "parameters": None}
        else:
            model_dir = Path(tmp) / "checkpoint"
            num_params = build_checkpoint(preset.model, model_dir, args.seed)
            model = {"random_llama": asdict(preset.model), "parameters": num_params}
        return run_with(args, preset, model_dir, model, device, dtype, Path(tmp) / "repo")


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
    from backend_lib.llm.core.engine import LLMEngine
    from tooling.repository import ModelSpec, write_model
    from tooling.tritonserver import TritonServer

    parameters = engine_parameters(model_dir, dtype, preset)
    write_model(
        ModelSpec(
            "llm",
            "llm",
            parameters,
            max_batch_size=0,
            instance_kind="KIND_GPU" if device.type == "cuda" else "KIND_CPU",
        ),
        repository,
    )
    # torch in the server's Python-backend stub reads OMP_NUM_THREADS when it starts.
    server_env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    progress(
        f"model {model['parameters'] or '?'} parameters, {dtype} on {device}; starting tritonserver"
    )
    started = time.perf_counter()
    with TritonServer(repository, env=server_env) as server:
        while not server.is_ready():
            time.sleep(0.2)
        server_start_s = time.perf_counter() - started
        progress(f"tritonserver ready after {server_start_s:.1f} s")
        engine = LLMEngine.from_config(from_parameters(LLMConfig, parameters), model_dir, device)
        fidelity = check_fidelity(
            server.grpc_url,
            engine,
            make_prompts(4, preset.prompt_len, vocab, f"{args.seed}-check"),
            preset.max_tokens,
        )
        runs, poisson_rate = [], None
        for repeat in range(args.repeats):
            for concurrency in preset.concurrencies:
                count = max(preset.min_requests, concurrency * preset.requests_per_client)
                prompts = make_prompts(
                    count, preset.prompt_len, vocab, f"{args.seed}-{repeat}-c{concurrency}"
                )
                systems = {
                    "served": lambda p=prompts, c=concurrency: served_closed_loop(
                        server.grpc_url, p, preset.max_tokens, c
                    ),
                    "direct": lambda p=prompts, c=concurrency: direct_closed_loop(
                        engine, p, preset.max_tokens, c
                    ),
                }
                names = list(systems)[::-1] if repeat % 2 else list(systems)  # alternate order
                for name in names:
                    run_ = Run(name, "closed", concurrency, None, repeat, systems[name]())
                    runs.append(run_)
                    metrics = run_.metrics()
                    progress(
                        f"repeat {repeat + 1}/{args.repeats} {name} concurrency {concurrency}:"
                        f" {metrics['output_tokens_per_s']:.1f} output tokens/s"
                    )
            if poisson_rate is None:
                top = next(r for r in reversed(runs) if r.system == "served")
                poisson_rate = POISSON_LOAD * top.metrics()["requests_per_s"]
            key = f"{args.seed}-{repeat}-poisson"
            prompts = make_prompts(preset.poisson_requests, preset.prompt_len, vocab, key)
            runs.append(
                Run(
                    "served",
                    "poisson",
                    None,
                    poisson_rate,
                    repeat,
                    served_poisson(server.grpc_url, prompts, preset.max_tokens, poisson_rate, key),
                )
            )
            progress(
                f"repeat {repeat + 1}/{args.repeats} served poisson {poisson_rate:.2f}/s: "
                f"{runs[-1].metrics()['output_tokens_per_s']:.1f} output tokens/s"
            )
    for run_ in runs:
        expected = preset.max_tokens
        if any(r.output_tokens != expected for r in run_.requests):
            raise SystemExit(f"a {run_.system} request produced other than {expected} tokens")
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
        "benchmark": NAME,
        "quick": args.quick,
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
        "machine": machine_info(),
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
        "### Serving: tritonserver llm model vs the direct engine",
        "",
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    concurrencies = result["workload"]["concurrencies"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for system, style in (("served", "o-"), ("direct", "s--")):
        rates = [result["output_tokens_per_second"][system][str(c)] for c in concurrencies]
        medians = [r["median"] for r in rates]
        errors = [
            [m - r["min"] for m, r in zip(medians, rates, strict=True)],
            [r["max"] - m for m, r in zip(medians, rates, strict=True)],
        ]
        ax.errorbar(concurrencies, medians, yerr=errors, fmt=style, capsize=3, label=system)
    ax.set(
        xscale="log",
        xlabel="concurrency (closed loop)",
        ylabel="output tokens/s",
        title="Served vs direct throughput",
    )
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend()
    paths = [out_dir / f"{NAME}_throughput.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in (
        (axes[0], "ttft_s", "time to first token"),
        (axes[1], "itl_s", "inter-token latency"),
    ):
        for color, c in enumerate(concurrencies):
            for system, style in (("served", "-"), ("direct", "--")):
                values = sorted(
                    v * 1000
                    for r in result["runs"]
                    if r["system"] == system and r["concurrency"] == c
                    for v in r["per_request"][key]
                )
                if values:
                    ax.plot(
                        values,
                        [(i + 1) / len(values) for i in range(len(values))],
                        style,
                        color=f"C{color}",
                        label=f"{system} c={c}",
                    )
        ax.set(xlabel="ms", ylabel="share of requests", title=f"{title} (CDF)", xscale="log")
    axes[1].legend(fontsize=7)
    paths.append(out_dir / f"{NAME}_latency_cdf.png")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and load (< 40 s)")
    parser.add_argument("--out", type=Path, default=Path(f"bench/results/{NAME}.json"))
    parser.add_argument("--device", default=None, help="cpu, cuda (default: CUDA if available)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads here and in the server (0: torch default)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default=None, help="serve this checkpoint directory instead of a random one"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
