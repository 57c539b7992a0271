"""A W4A16 checkpoint: the engine on a compressed-tensors W4A16 (4-bit, group 128, symmetric)
checkpoint against the engine on the same float checkpoint in bfloat16, and against OpenVINO
GenAI's continuous batching on its own int4 export of that float checkpoint (CPU, 1 and 2
threads).

The engine benchmark's random Llama (tooling.checkpoints FULL: hidden 512, 8 layers, GQA 8/2,
vocab 8192, 32.5M parameters; QUICK under --quick) is built in a temp dir, then quantized with
compressed-tensors' own API (tooling.quantized_checkpoints: every projection in groups of 128,
symmetric, min-max scales; embeddings and lm_head stay in full precision), which the engine loads
as stored (`quantization: auto`: the 4-bit layers run `WNA16Linear`, on CPU the C++ op
llm_cpu::wna16_linear where it is built, else its PyTorch twin; the result says which ran).

The workload is decode-bound: the engine benchmark's, with a quarter of the requests (16), prompts
a quarter as long (32-128 tokens) and outputs of 128-256 tokens (greedy, EOS ignored), so every
decode step has at most 16 rows: the regime where 4-bit weights pay, by reading a quarter of the
bytes per step (the C++ op unpacks them straight into its dot products: with AVX-512 at every
row count, with AVX2 below 64 rows, above which it dequantizes blocks for a GEMM). The engine benchmark's own workload
(64 requests, prompts 32-512, outputs 32-256) is timed too for the two engines and reported beside
(--no-engine-workload leaves it out).

- engine_w4a16: `LLMEngine.generate` on the W4A16 checkpoint, activations and KV cache in the
  baseline's dtype, a fresh engine (empty prefix cache) each run; the default `w4a16_activations:
  auto`, so in bfloat16 on a CPU with AVX512-VNNI the 4-bit layers quantize their activations to
  int8 per call, as the OpenVINO peer's CPU plugin does by default (the report says which ran);
- engine_bf16: the same on the float checkpoint in bfloat16 (`--dtype auto`: bfloat16 on CUDA and
  on CPUs with native bf16, float32 elsewhere, said in the report; float32 under --quick);
- openvino_genai: `ContinuousBatchingPipeline.generate` on `optimum-cli export openvino
  --weight-format int4 --group-size 128 --sym --ratio 1.0 --backup-precision none` (every
  projection int4 symmetric in groups of 128; `--backup-precision none` keeps the embeddings and
  lm_head in their original precision as ours, where NNCF's default would make them int8),
  inference and KV cache precision the baseline's dtype, in a worker of `.venv-peers`
  (bench.peers) with the same threads and token ids.

Before timing, the W4A16 engine's greedy tokens in float32 must equal transformers `generate` on
the checkpoint as compressed-tensors itself decompresses it (a few requests). The three systems
quantize differently (and 4-bit noise flips greedy choices of a random model at once), so their
tokens differ: greedy agreement with the W4A16 engine is reported, not required. All systems run
interleaved `--repeats` times per thread count; a summary figure is the worst thread count (ratios
of medians). Weight bytes: the 4-bit layers' bytes as loaded (`WNA16Linear.weight_bytes`) plus the
full-precision rest in bfloat16, against the bfloat16 model's parameter bytes. Where the time goes:
one more run of each engine under torch.profiler (bench.peers.time_split). The peers are skipped
in --quick mode (the report says why) unless --peers.

    python -m bench.quantized_engine [--quick] [--peers] [--thread-counts 1,2] [--dtype auto]
                                     [--repeats 3] [--no-engine-workload]
                                     [--out bench/results/quantized_engine.json]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from bench import cli, plots
from bench.engine_peers import MeteredEngine
from bench.llm import Workload, agreement, load_hf_model, make_workload, workload_record
from bench.output import progress
from bench.peers import plan, time_split
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from bench.timing import spread, time_interleaved
from tooling.checkpoints import FULL, GPU, QUICK, Sizes, build_random_llama
from tooling.hf_reference import hf_greedy

NAME = "quantized_engine"
HEADING = "W4A16 checkpoint: engine vs bfloat16 and vs OpenVINO GenAI int4"
DEFAULTS = cli.Defaults(
    cli.ByMode(quick="float32", cpu="auto", cuda="bfloat16"),
    threads=0,
    repeats=cli.ByMode(quick=1, cpu=3),
)
GROUP_SIZE = 128
OURS = "engine_w4a16"
BASELINE = "engine_bf16"
PEER = "openvino_genai"
CONVERSIONS = {PEER: "openvino-llm-int4"}
KEY_BF16 = "engine_w4a16_vs_bf16"
KEY_PEER = "engine_w4a16_vs_openvino_genai_int4"
KEY_BYTES = "w4a16_projection_bytes_vs_bf16"
WEIGHT_BYTES_TARGET = 0.3
"""The most the W4A16 model's projection bytes (KEY_BYTES) may be of the bfloat16 model's
(reported)."""
CHECK_TOKENS = 16


def decode_heavy(sizes: Sizes) -> Sizes:
    """The engine workload made decode-bound: a quarter of the requests, prompts a quarter as
    long, outputs from half the longest to the longest (FULL: 16 requests, 32-128 / 128-256)."""
    return replace(
        sizes,
        requests=max(4, sizes.requests // 4),
        prompt_len=(sizes.prompt_len[0], max(sizes.prompt_len[0], sizes.prompt_len[1] // 4)),
        output_len=(sizes.output_len[1] // 2, sizes.output_len[1]),
    )


def write_checkpoints(sizes: Sizes, scratch: Path, seed: int) -> tuple[Path, Path, int]:
    """The float random Llama and its W4A16 group-128 symmetric compressed-tensors checkpoint
    (siblings: the float one is what the peers convert, hashed whole); and its parameters."""
    from tooling.quantized_checkpoints import (
        PRESETS,
        with_group_size,
        write_compressed_tensors_checkpoint,
    )

    float_dir, w4a16_dir = scratch / "float", scratch / "w4a16"
    params = build_random_llama(sizes, float_dir, seed)
    scheme = with_group_size(PRESETS["W4A16_G128"], GROUP_SIZE)
    write_compressed_tensors_checkpoint(float_dir, w4a16_dir, scheme)
    return float_dir, w4a16_dir, params


# --- checks and static figures ------------------------------------------------------------------


def check_w4a16(w4a16_dir: Path, float_dir: Path, workload: Workload, device) -> dict:
    """The W4A16 engine's greedy tokens in float32 against transformers `generate` on
    compressed-tensors' own decompression of the checkpoint, on a few requests; SystemExit when
    they differ (in float32 the two compute the same products)."""
    import torch

    from tooling.quantized_checkpoints import reference_dequantized_weights

    check = Workload(workload.prompts[:4], [CHECK_TOKENS] * 4)
    hf = load_hf_model(float_dir, device, "float32")
    state = hf.state_dict()
    with torch.no_grad():
        for name, weight in reference_dequantized_weights(w4a16_dir).items():
            state[name].copy_(weight)
    reference = [hf_greedy(hf, prompt, CHECK_TOKENS) for prompt in check.prompts]
    del hf, state
    engine = MeteredEngine(w4a16_dir, "float32", device, quantization="auto")
    score = agreement(engine.run(check)[0], reference)
    record = {
        "reference": "transformers generate, float32, on compressed-tensors' decompression",
        "requests": len(check.prompts),
        "tokens_each": CHECK_TOKENS,
        "agreement": score,
        "passed": score["requests"] == 1.0,
    }
    progress(f"W4A16 engine (float32) vs compressed-tensors decompression: {score}")
    if not record["passed"]:
        raise SystemExit(
            f"the W4A16 engine's float32 greedy tokens differ from the reference: {score}"
        )
    return record


def loaded_layers(w4a16_dir: Path, dtype: str, device, parameters: int) -> dict:
    """What the W4A16 engine loads: its quantized layers' kernels and bytes, and the whole
    model's against the bfloat16 model's (the full-precision rest counted in bfloat16)."""
    from backend_lib.llm.execution.checkpoint_quantization.layers import WNA16Linear
    from bench.llm import new_engine

    engine = new_engine(w4a16_dir, device, dtype, max_model_len=1024, quantization="auto")
    layers = [m for m in engine.runner.model.modules() if isinstance(m, WNA16Linear)]
    quantized_bytes = sum(m.weight_bytes for m in layers)
    quantized_params = sum(m.in_features * m.out_features for m in layers)
    bf16 = 2  # bytes per bfloat16 parameter
    rest = (parameters - quantized_params) * bf16
    return {
        "wna16_layers": len(layers),
        "wna16_backends": dict(Counter(m.backend for m in layers)),
        "int8_activation_layers": sum(m.dynamic_int8 for m in layers),
        "w4a16_activations": engine.config.w4a16_activations,
        "bits": sorted({m.bits for m in layers}),
        "group_sizes": sorted({m.group_size for m in layers}),
        "cpu_extension": _cpu_extension_state() if device.type == "cpu" else None,
        "weight_bytes": {
            "quantized_layers": quantized_bytes,
            "quantized_layers_bf16": quantized_params * bf16,
            "full_precision_rest_bf16": rest,
            "w4a16_model": quantized_bytes + rest,
            "bf16_model": parameters * bf16,
            "quantized_parameters": quantized_params,
            "parameters": parameters,
            "projections_ratio": quantized_bytes / (quantized_params * bf16),
            "whole_model_ratio": (quantized_bytes + rest) / (parameters * bf16),
        },
    }


def _cpu_extension_state() -> dict:
    from kernels import cpu_extension

    loaded = cpu_extension.load()
    return {"loaded": loaded, "reason": None if loaded else cpu_extension.check_build()}


# --- measuring -----------------------------------------------------------------------------------


def run(args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    import torch

    device = cli.default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    sizes = {"quick": QUICK, "cuda": GPU, "cpu": FULL}[cli.mode(args.quick, device)]
    decode = decode_heavy(sizes)
    workloads = {
        "decode": make_workload(decode, args.seed),
        "engine": make_workload(sizes, args.seed),
    }
    progress(f"building the random Llama and its W4A16 g{GROUP_SIZE} checkpoint")
    float_dir, w4a16_dir, params = write_checkpoints(sizes, scratch, args.seed)
    fidelity = check_w4a16(w4a16_dir, float_dir, workloads["decode"], device)
    loaded = loaded_layers(w4a16_dir, dtype, device, params)
    progress(f"W4A16 layers: {loaded['wna16_backends']}; weight bytes {loaded['weight_bytes']}")
    no_peers = plan.why_no_peers(args, device)
    paths, reasons = {}, dict.fromkeys(CONVERSIONS, no_peers) if no_peers else {}
    if not no_peers:
        paths, reasons = plan.converted_models(CONVERSIONS, float_dir)
    thread_counts = args.thread_counts if device.type == "cpu" else [torch.get_num_threads()]
    runs = []
    for threads in thread_counts:
        worker = PeerWorker(threads) if paths else None
        try:
            one = measure(
                args,
                (float_dir, w4a16_dir),
                workloads,
                decode,
                threads,
                dtype,
                device,
                worker,
                paths,
            )
        finally:
            if worker:
                worker.close()
        one["excluded"] = {**reasons, **one["excluded"]}
        runs.append(one)
    keys = {(BASELINE, dtype): KEY_BF16, (PEER, dtype): KEY_PEER}
    summary, missing = plan.summarize(runs, keys, {}, no_peers)
    summary[KEY_BYTES] = loaded["weight_bytes"]["projections_ratio"]
    return {
        "device": str(device),
        "dtype": dtype,
        "native_bf16": plan.native_bf16() if device.type == "cpu" else True,
        "model": {**asdict(sizes), "parameters": params, "group_size": GROUP_SIZE},
        "workload": {
            **workload_record(workloads["decode"], args.seed),
            "prompt_len": list(decode.prompt_len),
            "output_len": list(decode.output_len),
        },
        "engine_workload": workload_record(workloads["engine"], args.seed),
        "repeats": args.repeats,
        "thread_counts": thread_counts,
        "fidelity": {"w4a16_vs_compressed_tensors": fidelity},
        **loaded,
        "peers": {"run": not no_peers, "reason": no_peers, "models": paths, "unavailable": reasons},
        "conversion": conversion_info(paths),
        "runs": runs,
        "summary": summary,
        "missing": missing,
    }


def resolve_dtype(dtype: str, device) -> str:
    """--dtype auto: bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" or plan.native_bf16() else "float32"


def measure(args, dirs, workloads, decode: Sizes, threads, dtype, device, worker, paths) -> dict:
    """One thread count: the engines and the peer on the decode workload (checked, then timed
    interleaved), the two engines on the engine workload, and where each engine's time goes."""
    import torch

    if device.type == "cpu":
        torch.set_num_threads(threads)
    progress(f"{threads} thread(s), {dtype}")
    float_dir, w4a16_dir = dirs
    work = workloads["decode"]
    seqs = max(64, decode.requests)
    engines = {
        OURS: MeteredEngine(w4a16_dir, dtype, device, seqs, quantization="auto"),
        BASELINE: MeteredEngine(float_dir, dtype, device, seqs, quantization="auto"),
    }
    outputs = {name: engine.run(work)[0] for name, engine in engines.items()}  # warm-up
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    systems = {
        name: plan.cpu_metered(_engine_run(engine, work), cpu[name], engine)
        for name, engine in engines.items()
    }
    settings, excluded = {}, {}
    if PEER in paths:
        try:
            settings[PEER] = worker.load(PEER, paths[PEER], dtype, **peer_settings(decode))
            outputs[PEER], _ = worker.generate(PEER, work.prompts, work.output_lens)
            cpu[PEER] = []
            systems[PEER] = plan.cpu_metered(_peer(worker, work), cpu[PEER], worker)
        except PeerError as exc:
            excluded[PEER] = f"failed: {exc}"
    agreements = {
        name: agreement(outputs[OURS], out) for name, out in outputs.items() if name != OURS
    }
    progress(f"greedy agreement with the W4A16 engine: {agreements}")
    seconds, _ = time_interleaved(systems, args.repeats)
    tokens = work.num_output_tokens
    beside = (
        engine_workload(engines, workloads["engine"], args.repeats)
        if args.engine_workload
        else None
    )
    progress("where the time goes: one more run of each engine under torch.profiler")
    split = {
        name: time_split.engine_split(engine.prepare(work), statistics.median(seconds[name]))
        for name, engine in engines.items()
    }
    return {
        "threads": threads,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "output_tokens_per_second": {
            n: spread([tokens / t for t in s]) for n, s in seconds.items()
        },
        "ratio_vs_ours": plan.ratios(seconds, OURS),
        "cores_busy": plan.cores_busy(seconds, cpu),
        "agreement_with_w4a16": agreements,
        "excluded": excluded,
        "peer_settings": settings,
        **({"engine_workload": beside} if beside else {}),
        "time_split": split,
    }


def engine_workload(engines: dict, workload: Workload, repeats: int) -> dict:
    """The two engines on the engine benchmark's workload, interleaved."""
    seconds, _ = time_interleaved(
        {name: _engine_run(engine, workload) for name, engine in engines.items()}, repeats
    )
    return {
        "seconds": seconds,
        "output_tokens_per_second": {
            n: spread([workload.num_output_tokens / t for t in s]) for n, s in seconds.items()
        },
        "w4a16_vs_bf16": plan.ratios(seconds, OURS)[BASELINE],
    }


def peer_settings(sizes: Sizes) -> dict:
    """OpenVINO GenAI's scheduler as engine_peers sets it (room for every request at once)."""
    return {
        "max_num_batched_tokens": 2048,
        "max_num_seqs": max(64, sizes.requests),
        "kv_cache_gb": 1,
    }


def _engine_run(engine: MeteredEngine, workload: Workload):
    return lambda: engine.run(workload)


def _peer(worker: PeerWorker, workload: Workload):
    return lambda: worker.generate(PEER, workload.prompts, workload.output_lens, outputs=False)


def conversion_info(paths: dict[str, str]) -> dict | None:
    """The peer conversion's record (its command, the IR's weight element types)."""
    import json

    if PEER not in paths:
        return None
    record = Path(paths[PEER]) / "conversion.json"
    return json.loads(record.read_text()) if record.exists() else None


# --- report --------------------------------------------------------------------------------------


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    model, work, engine_work = result["model"], result["workload"], result["engine_workload"]
    dtype = result["dtype"]
    bf16_note = (
        ""
        if dtype != "float32" or result["quick"]
        else " This CPU has no native bfloat16 (no AVX512-BF16/AMX): the baseline and the W4A16 "
        "run's activations are float32 here, so the figure is W4A16 vs float32."
    )
    lines = [
        f"Random-weight Llama, {model['parameters'] / 1e6:.1f}M parameters ({model['layers']} "
        f"layers, hidden {model['hidden']}); W4A16: every projection 4-bit symmetric in groups of "
        f"{model['group_size']} (compressed-tensors, min-max), embeddings and lm_head in full "
        f"precision. Activations and KV cache {dtype} in every system, on {result['device']}."
        f"{bf16_note} Decode-bound workload: {work['requests']} requests, prompts "
        f"{work['prompt_len'][0]}-{work['prompt_len'][1]}, outputs {work['output_len'][0]}-"
        f"{work['output_len'][1]} tokens ({work['prompt_tokens']} prompt, {work['output_tokens']} "
        f"output tokens, greedy, EOS ignored): at most {work['requests']} rows per decode step. "
        f"{result['repeats']} interleaved repeat(s) per thread count; the peer runs in a worker "
        "of .venv-peers with the same threads and token ids. The W4A16 engine's float32 greedy "
        "tokens equal transformers on compressed-tensors' own decompression "
        f"({result['fidelity']['w4a16_vs_compressed_tensors']['agreement']}); the systems "
        "quantize differently, so greedy agreement with the W4A16 engine is reported, not "
        "required.",
        "",
        "| threads | dtype | system | output tokens/s median (min-max) | W4A16 engine / system | "
        "cores busy | greedy agreement with W4A16 engine |",
        "|---|---|---|---|---|---|---|",
        *plan.system_rows(result, "output_tokens_per_second", "agreement_with_w4a16", _agreement),
        "",
    ]
    for run in result["runs"]:
        if "engine_workload" not in run:
            continue
        rates = run["engine_workload"]["output_tokens_per_second"]
        lines.append(
            f"- The engine benchmark's workload ({engine_work['requests']} requests, "
            f"{engine_work['prompt_tokens']} prompt / {engine_work['output_tokens']} output tokens; "
            f"decode steps of up to {min(64, engine_work['requests'])} rows), "
            f"{run['threads']} thread(s): W4A16 {rates[OURS]['median']:.1f}, {dtype} "
            f"{rates[BASELINE]['median']:.1f} output tokens/s: "
            f"{run['engine_workload']['w4a16_vs_bf16']:.2f}x."
        )
    lines += [*kernel_lines(result), *weight_lines(result), ""]
    for run in result["runs"]:
        lines += split_lines(run)
    lines += plan.summary_lines(result)
    return lines


def _agreement(score: dict) -> str:
    return f"{score['requests']:.1%} requests, {score['tokens']:.1%} tokens"


def kernel_lines(result: dict) -> list[str]:
    ext = result.get("cpu_extension")
    state = ""
    if ext is not None:
        state = (
            " (the C++ CPU kernels loaded)"
            if ext["loaded"]
            else f" (the C++ CPU kernels not loaded: {ext['reason']}; PyTorch paths everywhere)"
        )
    backends = ", ".join(f"{n} on `{b}`" for b, n in result["wna16_backends"].items())
    lines = [f"- Kernels: {result['wna16_layers']} `WNA16Linear` layers, {backends}{state}."]
    if "int8_activation_layers" in result:
        lines.append(
            f"- Activations (`w4a16_activations: {result['w4a16_activations']}`): "
            f"{result['int8_activation_layers']} of the layers quantize them to int8 per call "
            "(AVX512-VNNI dot products), the others multiply them as they are."
        )
    conversion = result.get("conversion")
    if conversion:
        lines.append(
            f"- OpenVINO export: `{conversion['command']}`; the IR's large weights by element "
            f"type: {conversion['weight_element_types']} (float: {conversion['float_weights']})."
        )
    return lines


def weight_lines(result: dict) -> list[str]:
    b = result["weight_bytes"]
    met = "met" if b["projections_ratio"] <= WEIGHT_BYTES_TARGET else "NOT met"
    return [
        f"- Weight bytes, W4A16 vs bfloat16: projections {b['quantized_layers'] / 1e6:.2f} MB "
        f"(4-bit words, scales and zero points as loaded) vs {b['quantized_layers_bf16'] / 1e6:.2f}"
        f" MB: **{b['projections_ratio']:.3f}x** (target <= {WEIGHT_BYTES_TARGET:g}x: {met}); "
        f"whole model (embeddings, lm_head and norms in bfloat16: "
        f"{b['full_precision_rest_bf16'] / 1e6:.2f} MB) {b['w4a16_model'] / 1e6:.2f} MB vs "
        f"{b['bf16_model'] / 1e6:.2f} MB: **{b['whole_model_ratio']:.3f}x**."
    ]


def split_lines(run: dict) -> list[str]:
    """Where each engine's time goes (torch.profiler shares scaled to its timed median)."""
    split = run["time_split"]
    names = list(split)
    rows = [
        ("GEMMs (W4A16: llm_cpu::wna16_linear + the lm_head)", "gemm"),
        ("attention", "attention"),
        ("other ops", "other_ops"),
        ("outside ops (Python, scheduling)", "outside_ops"),
        ("total", "wall"),
    ]
    lines = [
        f"Where the time goes at {run['threads']} thread(s), decode workload (seconds):",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += [
        f"| {label} | " + " | ".join(f"{split[n][key]:.2f}" for n in names) + " |"
        for label, key in rows
    ]
    peer = run["seconds"].get(PEER)
    if peer:
        lines.append(f"| OpenVINO GenAI int4, total | {statistics.median(peer):.2f} | |")
    return [*lines, ""]


def plot(result: dict, out_dir: Path) -> list[Path]:
    """Output tokens/s per system and thread count, decode workload."""
    fig, ax = plots.pyplot().subplots(figsize=(7, 3.5))
    colors = {OURS: "tab:green", BASELINE: "tab:gray", PEER: "tab:blue"}
    width = 0.8 / max(1, len(colors))
    for i, run in enumerate(result["runs"]):
        for j, (name, rate) in enumerate(run["output_tokens_per_second"].items()):
            medians, errors = plots.medians_and_errors([rate])
            x = i + (j - 1) * width
            ax.bar(
                [x],
                medians,
                width,
                yerr=errors,
                color=colors.get(name, "tab:orange"),
                label=name if i == 0 else None,
            )
            ax.annotate(f"{medians[0]:.0f}", (x, medians[0]), ha="center", va="bottom")
    ax.set_xticks(range(len(result["runs"])))
    ax.set_xticklabels([f"{run['threads']} thread(s)" for run in result["runs"]])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"W4A16 engine vs {result['dtype']} and OpenVINO int4 ({result['device']})")
    ax.legend()
    return [plots.save(fig, out_dir / "quantized_engine_throughput.png", dpi=110)]


def add_args(parser: argparse.ArgumentParser) -> None:
    plan.add_args(parser)
    parser.add_argument(
        "--engine-workload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the two engines on the engine benchmark's workload (default: %(default)s)",
    )


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, plot, add_args)

if __name__ == "__main__":
    BENCHMARK.main()
