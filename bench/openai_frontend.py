"""OpenAI frontend benchmark: streaming chat through `openai_frontend` vs the same requests over gRPC
streaming to tritonserver directly.

The default repository's `llm` (the Shakespeare model) is served by a tritonserver on a temporary
repository holding only that model; the frontend (`python -m openai_frontend`) runs as a subprocess
on a free port in front of it. Chat conversations are rendered once with the checkpoint's chat
template (the frontend's own tokenizer code), so both systems get the very same prompt text and the
same `sampling_parameters` (greedy, EOS ignored, fixed `max_tokens`):

- frontend: N concurrent asyncio clients (aiohttp, whose HTTP parser is C like gRPC's) streaming
  `POST /v1/chat/completions` (`stream_options.include_usage` gives the output token count);
- grpc: N concurrent asyncio clients (tritonclient.grpc.aio `stream_infer`) sending the inputs the
  frontend sends (text_input, stream, sampling_parameters, exclude_input_in_output and the
  return_finish_reason / num_input_tokens / num_output_tokens flags).

Before timing, every request's text through the frontend must equal its text over gRPC (first at
full concurrency; a request that differs is checked again alone on both sides, since a batch's
composition may flip a near-tie). Then closed-loop runs of both systems interleaved, alternating
which goes first; the figure is the ratio of the median output tokens/s. TTFT added by the
frontend: its TTFT minus the direct TTFT, at p50 and p99 over all timed requests.

    python -m bench.openai_frontend [--quick] [--threads 1] [--out bench/results/openai_frontend.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import cli, plots
from bench.output import progress
from bench.server import instance_kind, tritonserver
from bench.serving_load import RequestTiming, Run, llm_stream_inputs, stream_request
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import percentile, spread
from tooling.child_process import die_with_parent

NAME = "openai_frontend"
HEADING = "OpenAI frontend vs gRPC to tritonserver"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=2, cpu=3))
TARGET = target("openai_vs_grpc")
REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("frontend", "grpc")


@dataclass(frozen=True)
class Preset:
    concurrency: int
    requests: int
    """Requests per timed run (closed loop: each client sends its next when the last finished)."""
    max_tokens: int


PRESETS = {
    "quick": Preset(concurrency=4, requests=8, max_tokens=8),
    "cpu": Preset(concurrency=16, requests=48, max_tokens=48),
    "cuda": Preset(concurrency=16, requests=64, max_tokens=128),
}

_PLACES = ("Verona", "Mantua", "Elsinore", "the Forest of Arden", "Rome", "Athens", "Venice")
_WORDS = [
    "who",
    "goes",
    "there",
    "what",
    "news",
    "my",
    "lord",
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "love",
    "speak",
    "again",
    "fair",
    "night",
    "tomorrow",
    "sweet",
    "sorrow",
    "stand",
    "and",
    "unfold",
    "yourself",
    "where",
    "is",
    "the",
    "queen",
    "bid",
    "them",
    "come",
    "hither",
]


def make_conversations(count: int, key: str) -> list[list[dict[str, str]]]:
    """`count` seeded chat conversations (a scene and a user line of varied length)."""
    rng = random.Random(key)
    return [
        [
            {"role": "system", "content": f"A street in {rng.choice(_PLACES)}."},
            {
                "role": "user",
                "content": " ".join(
                    rng.choice(_WORDS) for _ in range(rng.randint(3, 40))
                ).capitalize()
                + "?",
            },
        ]
        for _ in range(count)
    ]


def sampling_parameters(max_tokens: int) -> dict:
    """What the frontend sends for `temperature=0, max_tokens, ignore_eos` (same keys, same order)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


# --- the two clients ------------------------------------------------------------------------------


async def frontend_request(session, messages: list[dict], max_tokens: int) -> RequestTiming:
    body = {
        "model": "llm",
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(time.perf_counter())
    pieces: list[str] = []
    async with session.post("/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"frontend answered {response.status}: {await response.read()}")
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                timing.end = time.perf_counter()
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"frontend stream failed: {chunk['error']}")
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                if text and timing.first_token is None:
                    timing.first_token = time.perf_counter()
                pieces.append(text)
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
    timing.text = "".join(pieces)
    if timing.end is None or timing.first_token is None:
        raise RuntimeError("the frontend stream ended without [DONE] or without text")
    return timing


GRPC_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
"""What the frontend asks the llm for, so the direct requests cost the server the same."""


async def grpc_request(client, prompt: str, max_tokens: int) -> RequestTiming:
    inputs = llm_stream_inputs(prompt, sampling_parameters(max_tokens), GRPC_FLAGS)
    return await stream_request(client, inputs)


async def _closed_loop(request, count: int, concurrency: int) -> list[RequestTiming]:
    results: list[RequestTiming | None] = [None] * count
    next_index = iter(range(count))

    async def client_loop() -> None:
        for i in next_index:  # shared: each client takes the next request when free
            results[i] = await request(i)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results  # type: ignore[return-value]


def frontend_closed_loop(
    url: str, conversations: list, max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    import aiohttp

    async def main() -> list[RequestTiming]:
        async with aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=concurrency),
            timeout=aiohttp.ClientTimeout(total=600),
        ) as session:
            return await _closed_loop(
                lambda i: frontend_request(session, conversations[i], max_tokens),
                len(conversations),
                concurrency,
            )

    return asyncio.run(main())


def grpc_closed_loop(
    url: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    import tritonclient.grpc.aio as aioclient

    async def main() -> list[RequestTiming]:
        client = aioclient.InferenceServerClient(url)
        try:
            return await _closed_loop(
                lambda i: grpc_request(client, prompts[i], max_tokens), len(prompts), concurrency
            )
        finally:
            await client.close()

    return asyncio.run(main())


# --- the frontend process -------------------------------------------------------------------------


class FrontendProcess:
    """`python -m openai_frontend` on a free port in front of `triton_url`."""

    def __init__(self, triton_url: str, repository: Path, log_path: Path):
        from tooling.tritonserver import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {
            k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "TRITON_ADMIN_KEY")
        }
        command = [sys.executable, "-m", "openai_frontend", "--triton-url", triton_url]
        command += ["--model-repository", str(repository), "--host", "127.0.0.1"]
        command += ["--port", str(self.port)]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent(),
            )

    def wait_ready(self, timeout: float = 120) -> float:
        import httpx

        started = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the frontend exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"]
                if any(m["id"] == "llm" for m in models):
                    return time.perf_counter() - started
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the frontend is not ready:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --- the benchmark -------------------------------------------------------------------------------


def llm_spec(device, dtype: str):
    """The default repository's llm, with its checkpoint's absolute path and the run's device."""
    from tooling.repository import DEFAULT_MODELS, ModelSpec

    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    parameters = {
        **spec.parameters,
        "model": str(REPO_ROOT / "models" / "shakespeare-llama"),
        "dtype": dtype,
    }
    return ModelSpec(
        "llm", "llm", parameters, max_batch_size=0, instance_kind=instance_kind(device)
    )


def check_fidelity(url: str, grpc_url: str, conversations, prompts, preset: Preset) -> dict:
    """Every request's text through the frontend equals its text over gRPC (warms both up)."""
    front = frontend_closed_loop(url, conversations, preset.max_tokens, preset.concurrency)
    direct = grpc_closed_loop(grpc_url, prompts, preset.max_tokens, preset.concurrency)
    differ = [i for i in range(len(prompts)) if front[i].text != direct[i].text]
    rechecked = []
    for i in differ:  # a batch's composition may flip a near-tie: compare alone on both sides
        alone_front = frontend_closed_loop(url, [conversations[i]], preset.max_tokens, 1)[0]
        alone_direct = grpc_closed_loop(grpc_url, [prompts[i]], preset.max_tokens, 1)[0]
        if alone_front.text != alone_direct.text:
            raise SystemExit(
                f"request {i}: the frontend's text differs from gRPC's:"
                f"\n frontend: {alone_front.text[:200]!r}\n grpc:     {alone_direct.text[:200]!r}"
            )
        rechecked.append(i)
    tokens = {r.output_tokens for r in front + direct}
    if tokens != {preset.max_tokens}:
        raise SystemExit(f"output token counts {tokens}, expected {preset.max_tokens}")
    progress(
        f"fidelity: {len(prompts)}/{len(prompts)} frontend texts equal gRPC's "
        f"({len(rechecked)} rechecked alone)"
    )
    return {
        "requests": len(prompts),
        "identical": len(prompts),
        "identical_at_concurrency": len(prompts) - len(differ),
        "rechecked_alone": rechecked,
        "passed": True,
    }


def run(args: argparse.Namespace, scratch: Path) -> dict:
    device, _, dtype = cli.setup_torch(args)
    preset = PRESETS[cli.mode(args.quick, device)]
    from openai_frontend.tokenization import load_tokenizer
    from tooling.repository import write_model

    spec = llm_spec(device, dtype)
    tokenizer = load_tokenizer(Path(spec.parameters["model"]))
    conversations = make_conversations(preset.requests, f"{args.seed}-chat")
    prompts = [tokenizer.render_chat(messages, "llm") for messages in conversations]
    repository = scratch / "repo"
    write_model(spec, repository)
    progress(f"llm ({dtype} on {device}); starting tritonserver")
    with tritonserver(repository, args.threads) as (server, server_start_s):
        frontend = FrontendProcess(server.grpc_url, repository, scratch / "frontend.log")
        try:
            frontend_start_s = frontend.wait_ready()
            progress(f"frontend ready after {frontend_start_s:.1f} s on {frontend.url}")
            fidelity = check_fidelity(frontend.url, server.grpc_url, conversations, prompts, preset)
            runs, client_cpu_ms = time_runs(
                frontend.url, server.grpc_url, conversations, prompts, preset, args
            )
        finally:
            stopping = time.perf_counter()
            frontend.stop()
            progress(f"frontend stopped in {time.perf_counter() - stopping:.1f} s")
        stopping = time.perf_counter()
    progress(f"tritonserver stopped in {time.perf_counter() - stopping:.1f} s")
    return build_result(
        args,
        preset,
        runs,
        client_cpu_ms,
        device,
        dtype,
        fidelity,
        spec.parameters,
        server_start_s,
        frontend_start_s,
        [len(tokenizer.encode(p)) for p in prompts],
    )


def time_runs(
    url, grpc_url, conversations, prompts, preset: Preset, args
) -> tuple[list[Run], dict[str, list[float]]]:
    """Both systems, `repeats` times, interleaved (the first one alternates); also the clients'
    CPU time per output token (this process, all threads), by system, in milliseconds."""
    systems = {
        "frontend": lambda: frontend_closed_loop(
            url, conversations, preset.max_tokens, preset.concurrency
        ),
        "grpc": lambda: grpc_closed_loop(grpc_url, prompts, preset.max_tokens, preset.concurrency),
    }
    runs, client_cpu_ms = [], {name: [] for name in SYSTEMS}
    for repeat in range(args.repeats):
        for name in SYSTEMS[::-1] if repeat % 2 else SYSTEMS:
            cpu_started = time.process_time()
            runs.append(Run(name, "closed", preset.concurrency, None, repeat, systems[name]()))
            tokens = sum(r.output_tokens for r in runs[-1].requests)
            client_cpu_ms[name].append((time.process_time() - cpu_started) * 1000 / tokens)
            progress(
                f"repeat {repeat + 1}/{args.repeats} {name}: "
                f"{runs[-1].metrics()['output_tokens_per_s']:.1f} output tokens/s"
            )
    for run_ in runs:
        if any(r.output_tokens != preset.max_tokens for r in run_.requests):
            raise SystemExit(
                f"a {run_.system} request produced other than {preset.max_tokens} tokens"
            )
    return runs, client_cpu_ms


def build_result(
    args,
    preset,
    runs,
    client_cpu_ms,
    device,
    dtype,
    fidelity,
    parameters,
    server_start_s,
    frontend_start_s,
    prompt_tokens,
) -> dict:
    rates = {
        s: [r.metrics()["output_tokens_per_s"] for r in runs if r.system == s] for s in SYSTEMS
    }
    ratio = statistics.median(rates["frontend"]) / statistics.median(rates["grpc"])
    ttft = {
        s: [t for r in runs if r.system == s for t in r.per_request()["ttft_s"]] for s in SYSTEMS
    }
    itl = {s: [t for r in runs if r.system == s for t in r.per_request()["itl_s"]] for s in SYSTEMS}
    by_run = {(r.system, r.repeat): r for r in runs}
    same_text = [
        a.text == b.text
        for k in range(args.repeats)
        for a, b in zip(by_run[("frontend", k)].requests, by_run[("grpc", k)].requests, strict=True)
    ]
    latency = {
        s: {
            "ttft_p50_s": percentile(ttft[s], 50),
            "ttft_p99_s": percentile(ttft[s], 99),
            "itl_p50_s": percentile(itl[s], 50),
            "itl_p99_s": percentile(itl[s], 99),
        }
        for s in SYSTEMS
    }
    return {
        "device": str(device),
        "dtype": dtype,
        "model": {"dir": parameters["model"], "name": "shakespeare-llama"},
        "workload": {
            "concurrency": preset.concurrency,
            "requests_per_run": preset.requests,
            "max_tokens": preset.max_tokens,
            "prompt_tokens": {"min": min(prompt_tokens), "max": max(prompt_tokens)},
            "greedy": True,
            "ignore_eos": True,
            "seed": args.seed,
        },
        "settings": {
            "llm_parameters": parameters,
            "frontend_client": "aiohttp.ClientSession, POST /v1/chat/completions stream=true",
            "grpc_client": "tritonclient.grpc.aio stream_infer",
            "threads": {"server": args.threads or "torch default"},
        },
        "repeats": args.repeats,
        "server_start_s": server_start_s,
        "frontend_start_s": frontend_start_s,
        "fidelity": fidelity,
        "timed_same_text": sum(same_text) / len(same_text),
        "output_tokens_per_second": {s: spread(rates[s]) for s in SYSTEMS},
        "latency": latency,
        "client_cpu_ms_per_token": {s: spread(client_cpu_ms[s]) for s in SYSTEMS},
        "ttft_added_s": {
            "p50": latency["frontend"]["ttft_p50_s"] - latency["grpc"]["ttft_p50_s"],
            "p99": latency["frontend"]["ttft_p99_s"] - latency["grpc"]["ttft_p99_s"],
        },
        "runs": [r.record() for r in runs],
        "summary": {"openai_vs_grpc": ratio},
    }


# --- report and plots ----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def report(result: dict) -> list[str]:
    workload, ratio = result["workload"], result["summary"]["openai_vs_grpc"]
    added = result["ttft_added_s"]
    lines = [
        f"The default llm (Shakespeare model, {result['dtype']}, {result['device']}) served by "
        f"tritonserver; {workload['concurrency']} concurrent streaming clients, "
        f"{workload['requests_per_run']} chat requests per run (prompts of "
        f"{workload['prompt_tokens']['min']}-{workload['prompt_tokens']['max']} tokens, "
        f"{workload['max_tokens']} output tokens each, greedy, EOS ignored). Frontend: "
        "`POST /v1/chat/completions` with `stream: true` through `python -m openai_frontend`; "
        "grpc: the same rendered prompts and sampling parameters as `stream_infer` to "
        f"tritonserver. Every request's text through the frontend equals its gRPC text (checked on "
        f"{result['fidelity']['requests']} requests before timing; "
        f"{result['timed_same_text']:.0%} identical in the timed runs). Medians over "
        f"{result['repeats']} interleaved repeats; TTFT and ITL percentiles over all timed requests.",
        "",
        "| system | output tok/s median (min-max) | TTFT p50/p99 ms | ITL p50/p99 ms |",
        "|---|---|---|---|",
    ]
    for system in SYSTEMS:
        rates, lat = result["output_tokens_per_second"][system], result["latency"][system]
        lines.append(
            f"| {system} | {rates['median']:.1f} ({rates['min']:.1f}-{rates['max']:.1f}) | "
            f"{_ms(lat['ttft_p50_s'])} / {_ms(lat['ttft_p99_s'])} | "
            f"{_ms(lat['itl_p50_s'])} / {_ms(lat['itl_p99_s'])} |"
        )
    met = "met" if ratio >= TARGET else "NOT met"
    lines += [
        "",
        f"TTFT added by the frontend: {_ms(added['p50'])} ms at p50, {_ms(added['p99'])} ms at p99.",
        "",
        "The clients share the machine with the servers; their CPU per output token (this process, "
        "median): "
        + ", ".join(f"{s} {result['client_cpu_ms_per_token'][s]['median']:.3f} ms" for s in SYSTEMS)
        + ".",
        "",
        f"Target: frontend output tokens/s >= {TARGET} x gRPC: {ratio:.3f} ({met}).",
        "",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    fig, (bars, cdf) = plots.pyplot().subplots(1, 2, figsize=(9, 3.5))
    medians, errors = plots.medians_and_errors(
        result["output_tokens_per_second"][s] for s in SYSTEMS
    )
    bars.bar(SYSTEMS, medians, yerr=errors, capsize=4, color=["C0", "C1"])
    bars.set(ylabel="output tokens/s", title=f"{result['workload']['concurrency']} streams")
    for color, system in enumerate(SYSTEMS):
        values = [
            v * 1000
            for r in result["runs"]
            if r["system"] == system
            for v in r["per_request"]["ttft_s"]
        ]
        cdf.plot(*plots.cdf(values), color=f"C{color}", label=system)
    cdf.set(xlabel="ms", ylabel="share of requests", title="time to first token (CDF)")
    cdf.legend()
    return [plots.save(fig, out_dir / f"{NAME}_throughput_ttft.png")]


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot)

if __name__ == "__main__":
    BENCHMARK.main()
