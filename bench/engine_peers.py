"""LLM engine vs OpenVINO GenAI's continuous batching and CTranslate2, on CPU at 1 and 2 threads.

The engine benchmark's random Llama and workload (tooling.checkpoints FULL: 64 requests, prompts
32-512 and outputs 32-256 tokens, greedy, EOS ignored). The peers cannot share our process (their
environment, `.venv-peers`, pins another transformers): they run in a worker process there
(bench.peers) with the same thread count, given the same prompt token ids and max_tokens, timed
by the worker around their generate call while ours waits. The checkpoint is exported once to
OpenVINO IR (optimum-intel, fp32 weights) and to CTranslate2 (float32), cached in .cache/.

- engine: `LLMEngine.generate`, all requests at once, a fresh engine (empty cache) each run;
- openvino_genai: `ContinuousBatchingPipeline.generate`, all requests at once, each with its own
  max_new_tokens (2048 batched tokens, 64 sequences, split-fuse on, prefix caching off);
- ctranslate2: `Generator.generate_batch` on static batches of 16 in arrival order (it has no
  continuous batching), each batch to its longest output.

After float32, "kv-int8": float32 weights over an 8-bit KV cache on both sides, the engine's
`kv_cache_dtype: int8` (symmetric, a scale per token and kv head) against OpenVINO GenAI's
`KV_CACHE_PRECISION: u8` (its CPU plugin's 8-bit cache, asymmetric per token); agreement
reported, not required (the two quantize differently); CTranslate2 has no 8-bit KV cache.

Per precision (float32; bfloat16 only where the CPU has native bf16) and thread count, every
system runs the workload once untimed and its greedy tokens are compared with the engine's
(float32: identical required, else it gets no figure, except where an output parts from ours at
an exact tie of our top two logits, checked with transformers: the one place two exact float32
implementations may choose differently; bfloat16: agreement reported); then all
run interleaved `--repeats` times. A summary figure (engine speed / peer speed, medians) is the
worst thread count. In float32, where OpenVINO GenAI was timed, the report then says where the
time goes side by side (bench.peers.time_split: the engine's run split by kind under
torch.profiler, OpenVINO's MatMul rate against ours on the model's shapes). In --quick mode the
peers are skipped (the report says why) unless --peers.

    python -m bench.engine_peers [--quick] [--peers] [--thread-counts 1,2] [--dtype auto]
                                 [--repeats 1] [--out bench/results/engine_peers.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench import cli
from bench.engine import EngineRunner
from bench.llm import Workload, agreement, make_workload, workload_record
from bench.output import progress
from bench.peers import plan, time_split
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from bench.timing import spread, time_interleaved
from tooling.checkpoints import FULL, QUICK, build_random_llama

NAME = "engine_peers"
HEADING = "LLM engine vs OpenVINO GenAI and CTranslate2 (CPU)"
# One timed repeat: with CTranslate2's static batches (~3.5x the engine's time) and the check run
# before it, each thread count takes ~5 minutes on 2 cores; the suite allows 15 in all.
DEFAULTS = cli.Defaults(plan.DTYPE, threads=0, repeats=1)
CONVERSIONS = {"openvino_genai": "openvino-llm", "ctranslate2": "ctranslate2-llm"}
KEYS = {
    ("openvino_genai", "float32"): "engine_vs_openvino_genai",
    ("openvino_genai", "bfloat16"): "engine_bf16_vs_openvino_genai_bf16",
    ("ctranslate2", "float32"): "engine_vs_ctranslate2",
    ("openvino_genai", "kv-int8"): "engine_kv_int8_vs_openvino_genai",
}
KV_VARIANTS = {
    "kv-int8": {
        "weights": "float32",
        "engine": {"kv_cache_dtype": "int8"},
        "peers": {"openvino_genai": {"kv_cache_precision": "u8"}},
    }
}
"""Labels measured after float32: 8-bit KV caches (the engine's setting, each peer's own)."""
TIE_TOLERANCE = 1e-5
"""Relative gap between the top two logits under which they count as tied (float32 rounding)."""
KV_CACHE_GB = 1
"""OpenVINO GenAI's KV cache: room for every request of the workload at once (~0.4 GB f32)."""


def peer_settings(sizes) -> dict[str, dict]:
    return {
        "openvino_genai": {
            "max_num_batched_tokens": 2048,
            "max_num_seqs": max(64, sizes.requests),
            "kv_cache_gb": KV_CACHE_GB,
        },
        "ctranslate2": {"static_batch": sizes.static_batch},
    }


class MeteredEngine(EngineRunner):
    """The engine benchmark's runner, also counting the CPU seconds of the timed generate."""

    cpu_seconds = 0.0

    def run(self, workload: Workload) -> tuple[list[list[int]], float]:
        generate = self.prepare(workload)
        cpu, started = time.process_time(), time.perf_counter()
        outputs = generate()
        seconds = time.perf_counter() - started
        self.cpu_seconds = time.process_time() - cpu
        return [out.outputs[0].token_ids for out in outputs], seconds


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    device = cli.default_device(args.device)
    sizes = QUICK if args.quick else FULL
    workload = make_workload(sizes, args.seed)
    num_params = build_random_llama(sizes, model_dir, args.seed)
    measured = plan.measure_all(
        args,
        device,
        model_dir,
        CONVERSIONS,
        KEYS,
        lambda threads, dtype, worker, paths: measure(
            args, model_dir, workload, sizes, threads, dtype, worker, paths
        ),
        variants={"float32": tuple(KV_VARIANTS)},
    )
    return {
        "device": str(device),
        "model": {**asdict(sizes), "parameters": num_params},
        "workload": workload_record(workload, args.seed),
        "repeats": args.repeats,
        **measured,
        "settings": {"peers": peer_settings(sizes)},
    }


def measure(args, model_dir, workload: Workload, sizes, threads, dtype, worker, paths) -> dict:
    """One precision (or KV_VARIANTS label) at one thread count: the engine and each peer
    checked, then timed."""
    import torch

    torch.set_num_threads(threads)
    progress(f"{threads} thread(s), {dtype}")
    variant = KV_VARIANTS.get(dtype)
    weights = variant["weights"] if variant else dtype
    if variant:  # only the peers with an 8-bit KV cache of their own
        paths = {name: path for name, path in paths.items() if name in variant["peers"]}
    engine = MeteredEngine(
        model_dir,
        weights,
        torch.device("cpu"),
        max(64, sizes.requests),
        **(variant["engine"] if variant else {}),
    )
    reference, _ = engine.run(workload)  # warm-up, and the tokens every peer must give
    cpu: dict[str, list[float]] = {"engine": []}
    systems = {"engine": plan.cpu_metered(lambda: engine.run(workload), cpu["engine"], engine)}
    settings, agreements, excluded = {}, {}, {}
    for name, path in paths.items():
        try:
            kv = variant["peers"][name] if variant else {}
            settings[name] = worker.load(name, path, weights, **peer_settings(sizes)[name], **kv)
            outputs, _ = worker.generate(name, workload.prompts, workload.output_lens)
        except PeerError as exc:
            excluded[name] = f"failed: {exc}"
            continue
        agreements[name] = agreement(reference, outputs)
        if dtype == "float32" and agreements[name]["requests"] < 1.0:
            partings = parting_points(model_dir, workload, reference, outputs)
            agreements[name]["parted_at_ties"] = sum(p["tie"] for p in partings)
            agreements[name]["partings"] = partings
        progress(f"{name}: greedy agreement with the engine {agreements[name]}")
        if dtype == "float32" and not all(p["tie"] for p in agreements[name].get("partings", [])):
            excluded[name] = f"float32 greedy tokens differ from the engine's ({agreements[name]})"
            continue
        cpu[name] = []
        systems[name] = plan.cpu_metered(_peer(worker, name, workload), cpu[name], worker)
    seconds, _ = time_interleaved(systems, args.repeats)
    tokens = workload.num_output_tokens
    split = where_time_goes(engine, workload, sizes, worker, seconds, dtype)
    return {
        "threads": threads,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "output_tokens_per_second": {
            n: spread([tokens / t for t in s]) for n, s in seconds.items()
        },
        "ratio_vs_ours": plan.ratios(seconds, "engine"),
        "cores_busy": plan.cores_busy(seconds, cpu),
        "agreement_with_engine": agreements,
        "excluded": excluded,
        "peer_settings": settings,
        **({"time_split_vs_openvino_genai": split} if split else {}),
    }


def where_time_goes(engine, workload: Workload, sizes, worker, seconds, dtype: str) -> dict | None:
    """The engine's time by kind next to OpenVINO GenAI's (float32, when it was timed)."""
    if dtype != "float32" or "openvino_genai" not in seconds:
        return None
    progress("where the time goes: a profiled engine run, then GEMM rates side by side")
    ours = statistics.median(seconds["engine"])
    split = time_split.engine_split(engine.prepare(workload), ours)
    try:
        rates = time_split.gemm_rates(worker, time_split.weight_shapes(sizes))
    except PeerError as exc:
        return {"failed": f"OpenVINO MatMul: {exc}", "engine_seconds": split}
    peer_seconds = statistics.median(seconds["openvino_genai"])
    mix = time_split.token_mix(sum(map(len, workload.prompts)), workload.num_output_tokens)
    return {**time_split.side_by_side(split, rates, mix, peer_seconds), "gemm_rates": rates}


def parting_points(model_dir: Path, workload: Workload, ours, theirs) -> list[dict]:
    """Where each differing output first parts from ours, and whether our top two logits there
    (transformers' forward of the prompt and our tokens so far) tie: a tie is the one place two
    exact float32 implementations may choose differently (batch shapes change the rounding)."""
    import torch

    from bench.llm import load_hf_model

    model = load_hf_model(model_dir, torch.device("cpu"), "float32")
    partings = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            continue
        at = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        with torch.inference_mode():
            logits = model(torch.tensor([workload.prompts[i] + a[:at]])).logits[0, -1]
        top = float(logits.max())
        gap = (top - float(logits[b[at]])) / max(1.0, abs(top))
        tie = gap <= TIE_TOLERANCE
        partings.append(
            {"request": i, "at": at, "ours": a[at], "theirs": b[at], "gap": gap, "tie": tie}
        )
    return partings


def _peer(worker: PeerWorker, name: str, workload: Workload):
    return lambda: worker.generate(name, workload.prompts, workload.output_lens, outputs=False)


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work = result["model"], result["workload"]
    lines = [
        f"Random-weight Llama, {model['parameters'] / 1e6:.1f}M parameters, {work['requests']} "
        f"requests ({work['prompt_tokens']} prompt, {work['output_tokens']} output tokens, greedy, "
        f"EOS ignored), {result['repeats']} interleaved repeat(s) per thread count. The peers run "
        "in a worker process of their own environment (.venv-peers: not the same process), with "
        "the same threads and token ids, timed around their generate call (cores busy: CPU "
        "seconds per wall second). OpenVINO GenAI: "
        "continuous batching; CTranslate2: static batches of "
        f"{model['static_batch']} (it has no continuous batching). Greedy tokens are compared with "
        "the engine's before timing (float32: identical, or parting only where our top two logits "
        "tie).",
        "",
        "| threads | dtype | system | output tokens/s median (min-max) | engine / system | "
        "cores busy | greedy agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += plan.system_rows(
        result, "output_tokens_per_second", "agreement_with_engine", _agreement
    )
    lines.append("")
    for run in result["runs"]:
        split = run.get("time_split_vs_openvino_genai")
        if split and "failed" not in split:
            lines += time_split.report_lines(split, run["threads"])
    return [*lines, *plan.summary_lines(result)]


def _agreement(score: dict) -> str:
    ties = score.get("parted_at_ties")
    parted = f" ({ties} parted at an exact tie of the top two logits)" if ties else ""
    return f"{score['requests']:.1%} requests, {score['tokens']:.1%} tokens{parted}"


# No plot: the table holds every thread count and dtype.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=plan.add_args)

if __name__ == "__main__":
    BENCHMARK.main()
