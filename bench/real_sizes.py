"""Real sizes: the engine on a random Llama of Llama-3.2-1B's shape against OpenVINO GenAI and
llama.cpp, on the same weights and the same prompts, at each precision, thread count and
concurrency (CPU); and the default benchmark model (tooling.checkpoints FULL, 32.5M parameters)
at one request against OpenVINO GenAI.

The models (bench.real_size_models, cached under .cache/real-sizes/): the float32 checkpoint,
its compressed-tensors W4A16 g128 checkpoint, and GGUF files of it. Per precision (PRECISIONS):

| precision | this engine | OpenVINO GenAI (its export, inference hint) | llama.cpp |
|---|---|---|---|
| f32 | the F32 GGUF, float32 | fp32 IR, f32 | the F32 GGUF |
| bf16 | the BF16 GGUF, bfloat16 | fp32 IR, bf16 | the BF16 GGUF |
| int8 | the checkpoint, `quantization: int8` | its int8 export, bf16 | the Q8_0 GGUF |
| int4 | the W4A16 g128 checkpoint | its int4 g128 export, bf16 | - |
| q4_0 | the Q4_0 GGUF | - | the Q4_0 GGUF |

(without native bf16 the quantized rows' activations are float32, and bf16 is skipped; the
engine's 4-bit rows then quantize them to int8, `w4a16_activations: int8`, where its int8 dot runs.)

A workload at concurrency c is c requests of `--prompt-tokens` random token ids and
`--output-tokens` greedy tokens (EOS ignored), all submitted at once. The engine: `generate`
with prefix caching off (OpenVINO GenAI's off too; llama.cpp's cache emptied per request), one
engine per precision and thread count. OpenVINO GenAI: its ContinuousBatchingPipeline driven
with `add_request`/`step` (each token's arrival timed). llama.cpp: llama-cpp-python's `Llama`
(built from source for this CPU: bench.peers.env), at concurrency 1 only (its Python API decodes
one sequence). Peers run in a worker of `.venv-peers` with the same threads and token ids.

Before timing, each peer's greedy tokens on one request are compared with the engine's
(agreement reported; at the f32 precision they must agree on every token, else the peer gets
no figure). Then, per concurrency, the systems run interleaved `--repeats` times. Figures:
output tokens/s (all requests' tokens / wall seconds), time to first token and time per output
token after the first (per request; p50/p99 over requests and repeats), decode tokens/s at
concurrency 1 (1 / median time per output token), weight bytes read per decoded token (every
weight but the token embedding, as each system holds it), and the bandwidth fraction: bytes per
token x decode tokens/s / what a plain read streams on the same threads (bench.gemv_bandwidth),
measured just before and just after that precision's one-request timing (their mean). Summary
figures are the worse of the thread counts.

    python -m bench.real_sizes [--quick] [--peers] [--thread-counts 1,2] [--concurrency 1,4,16,64]
        [--precisions f32,bf16,int8,int4,q4_0] [--concurrent-precisions bf16,int4]
        [--prompt-tokens 128] [--output-tokens 64] [--repeats 2]
        [--out bench/results/real_sizes.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench import cli
from bench.llm import agreement, greedy, new_engine
from bench.output import progress
from bench.peers import plan
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from bench.timing import p50_p99_ms, spread, time_interleaved

NAME = "real_sizes"
HEADING = "Real sizes: a 1B Llama vs OpenVINO GenAI and llama.cpp (CPU)"
DEFAULTS = cli.Defaults("auto", threads=0, repeats=cli.ByMode(quick=1, cpu=2))


@dataclass(frozen=True)
class Precision:
    """One row of the comparison: which model each system runs, in which activation dtype."""

    name: str
    dtype: str
    """The activations' dtype on every side ("float32" | "bfloat16")."""
    ours: str
    """The engine's model: "hf", "w4a16" or "gguf:<TYPE>"."""
    ours_settings: dict = field(default_factory=dict)
    openvino: str | None = None
    """OpenVINO GenAI's conversion target (bench.peers.convert), or None."""
    llama_cpp: str | None = None
    """llama.cpp's GGUF type, or None."""


PRECISIONS = {
    "f32": Precision("f32", "float32", "gguf:F32", {}, "openvino-llm", "F32"),
    "bf16": Precision("bf16", "bfloat16", "gguf:BF16", {}, "openvino-llm", "BF16"),
    "int8": Precision(
        "int8", "bfloat16", "hf", {"quantization": "int8"}, "openvino-llm-int8", "Q8_0"
    ),
    "int4": Precision("int4", "bfloat16", "w4a16", {"quantization": "auto"}, "openvino-llm-int4"),
    "q4_0": Precision("q4_0", "bfloat16", "gguf:Q4_0", {}, None, "Q4_0"),
}
KEYS = {
    "c1_bandwidth_fraction": ("f32", "bf16", "int4"),
    "c1_decode_vs_openvino_genai": ("f32", "bf16", "int4"),
    "c1_decode_vs_llama_cpp": ("f32", "bf16", "q4_0"),
    "c16_throughput_vs_openvino_genai": ("bf16", "int4"),
}
"""Summary figures: key prefix -> the precisions it is given for (`<prefix>_<precision>`)."""
SMALL_KEY = "small_model_c1_vs_openvino_genai"
PEERS = {"openvino_genai": "openvino_genai_stepped", "llama_cpp": "llama_cpp"}
"""Our name for each peer -> the worker's system."""
QUICK_SHAPE = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, vocab=1024)


# --- the workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_tokens: int

    @property
    def max_tokens(self) -> list[int]:
        return [self.output_tokens] * len(self.prompts)


def make_workload(concurrency: int, prompt_tokens: int, output_tokens: int, vocab: int) -> Workload:
    """`concurrency` prompts of random token ids (ids 3+: no special token), seeded by size."""
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(concurrency)]
    return Workload(prompts, output_tokens)


# --- the engine's side ---------------------------------------------------------------------------


class OurEngine:
    """One engine (prefix caching off) run on workloads, with each request's latencies."""

    def __init__(self, model: Path, dtype: str, max_num_seqs: int, max_model_len: int, **settings):
        from backend_lib.checkpoint import resolve_model_path

        self.engine = new_engine(
            resolve_model_path(str(model), model.parent),  # a GGUF file: its conversion
            _cpu(),
            dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=False,
            cpu_kv_cache_gb=4,
            **settings,
        )
        self.latencies: list[dict] = []

    def run(self, workload: Workload) -> tuple[list[list[int]], float]:
        """Greedy outputs and the wall seconds of `generate`; `latencies` per request."""
        import time

        params = [greedy(n) for n in workload.max_tokens]
        started = time.perf_counter()
        outputs = self.engine.generate(workload.prompts, params)
        seconds = time.perf_counter() - started
        self.latencies = [_latency(out) for out in outputs]
        return [out.outputs[0].token_ids for out in outputs], seconds

    def weight_bytes_per_token(self) -> int:
        return weight_bytes_per_token(self.engine.runner.model)


def _model_len(args) -> int:
    return args.prompt_tokens + args.output_tokens


def _latency(output) -> dict:
    m, n = output.metrics, len(output.outputs[0].token_ids)
    tpot = (m.last_token_time - m.first_token_time) / (n - 1) if n > 1 else None
    return {"ttft": m.first_token_time - m.arrival_time, "tpot": tpot, "tokens": n}


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads, as the model holds them: each projection and the
    head (quantized layers: their `weight_bytes`), the norms; not the token embedding (one row a
    token)."""
    import torch

    from backend_lib.linear import PackedLinear
    from backend_lib.quantization import QuantizedLinear

    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        if hasattr(module, "weight_bytes"):
            total += module.weight_bytes
        elif isinstance(module, QuantizedLinear):
            total += module.in_features * module.out_features + module.scale.numel() * 4
        elif isinstance(module, PackedLinear):
            total += module.in_features * module.out_features * _element_size(model)
        else:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def _element_size(model) -> int:
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return torch.empty((), dtype=dtype).element_size()


def _cpu():
    import torch

    return torch.device("cpu")


# --- one precision at one thread count ----------------------------------------------------------


@dataclass
class Systems:
    """The systems compared at one precision and thread count: each a callable running a
    workload -> (outputs, seconds), with its per-request latencies after each run."""

    ours: OurEngine
    worker: PeerWorker | None
    peers: dict[str, str] = field(default_factory=dict)
    """Our name of each loaded peer -> its worker system."""

    def runner(self, name: str, workload: Workload):
        if name == "engine":
            return lambda: self.ours.run(workload)
        system = self.peers[name]
        return lambda: self.worker.generate(system, workload.prompts, workload.max_tokens)

    def latencies(self, name: str) -> list[dict]:
        return self.ours.latencies if name == "engine" else (self.worker.latencies or [])

    def takes(self, name: str, concurrency: int) -> bool:
        """Whether `name` runs this concurrency (llama.cpp's Python API: one sequence)."""
        return name == "engine" or (
            name in self.peers and (name != "llama_cpp" or concurrency == 1)
        )


def measure(args, precision: Precision, threads: int, worker, peer_paths: dict) -> dict:
    """Every concurrency of one precision at one thread count: checked, then timed."""
    import torch

    torch.set_num_threads(threads)
    progress(f"{threads} thread(s), {precision.name}")
    model, settings = ours_model(args, precision)
    dtype = activation_dtype(precision)
    ours = OurEngine(model, dtype, max(args.concurrency), _model_len(args), **settings)
    systems = Systems(ours, worker)
    check = make_workload(1, args.prompt_tokens, args.output_tokens, args.vocab)
    reference, _ = ours.run(check)
    loaded, agreements, excluded = {}, {}, {}
    for name, path in peer_paths.items():
        try:
            loaded[name] = load_peer(worker, name, path, dtype, args)
            outputs, _ = worker.generate(PEERS[name], check.prompts, check.max_tokens)
        except PeerError as exc:
            excluded[name] = f"failed: {exc}"
            continue
        agreements[name] = agreement(reference, outputs)
        progress(f"{name}: greedy agreement with the engine {agreements[name]}")
        # Float weights in float32 must agree; quantized rows run in float32 only for want of
        # native bf16, and their peers' rounding differs (int8 activations, their own export).
        if precision.dtype == "float32" and agreements[name]["tokens"] < 1.0:
            excluded[name] = f"float32 greedy tokens differ from the engine's ({agreements[name]})"
            continue
        systems.peers[name] = PEERS[name]
    levels = [c for c in args.concurrency if c == 1 or _concurrent(args, precision)]
    by_concurrency, reads = [], []
    for concurrency in levels:
        # The plain read brackets the one-request timing: this shared machine's memory bandwidth
        # drifts over a run (32-41 GB/s on 2 threads), so one figure from its start is not the
        # limit a later timing ran under.
        if concurrency == 1:
            reads.append(plain_read_gb_per_s(threads))
        by_concurrency.append(time_concurrency(args, systems, concurrency, args.vocab))
        if concurrency == 1:
            reads.append(plain_read_gb_per_s(threads))
    bandwidth = statistics.mean(reads) if reads else None
    bytes_per_token = {
        "engine": ours.weight_bytes_per_token(),
        **peer_bytes(args, precision, worker, peer_paths),
    }
    record = {
        "threads": threads,
        "precision": precision.name,
        "dtype": dtype,
        "model": {"engine": str(model), **{n: str(p) for n, p in peer_paths.items()}},
        "engine_settings": settings,
        "peer_settings": loaded,
        "agreement_with_engine": agreements,
        "excluded": excluded,
        "concurrency": by_concurrency,
        "weight_bytes_per_token": bytes_per_token,
        "plain_read_gb_per_s": bandwidth,
        "plain_read_samples_gb_per_s": reads,
        "bandwidth_fraction": bandwidth_fractions(by_concurrency, bytes_per_token, bandwidth),
    }
    del systems, ours
    gc.collect()
    return record


def time_concurrency(args, systems: Systems, concurrency: int, vocab: int) -> dict:
    """The systems interleaved on `concurrency` requests: their rates and latencies."""
    workload = make_workload(concurrency, args.prompt_tokens, args.output_tokens, vocab)
    names = [n for n in ("engine", *systems.peers) if systems.takes(n, concurrency)]
    latencies: dict[str, list[dict]] = {n: [] for n in names}

    def timed(name):
        run = systems.runner(name, workload)

        def call():
            outputs, seconds = run()
            latencies[name].extend(systems.latencies(name))
            return outputs, seconds

        return call

    seconds, _ = time_interleaved({n: timed(n) for n in names}, args.repeats)
    tokens = concurrency * args.output_tokens
    return {
        "requests": concurrency,
        "seconds": seconds,
        "output_tokens_per_second": {
            n: spread([tokens / t for t in s]) for n, s in seconds.items()
        },
        "ttft_ms": {n: p50_p99_ms([x["ttft"] for x in lat]) for n, lat in latencies.items()},
        "tpot_ms": {
            n: p50_p99_ms([x["tpot"] for x in lat if x["tpot"] is not None])
            for n, lat in latencies.items()
        },
        "decode_tokens_per_second": {
            n: 1.0 / statistics.median(x["tpot"] for x in lat if x["tpot"])
            for n, lat in latencies.items()
            if any(x["tpot"] for x in lat)
        },
    }


def at_concurrency(by_concurrency: list[dict], requests: int) -> dict | None:
    """The timing of `requests` requests at once, None if not run."""
    return next((t for t in by_concurrency if t["requests"] == requests), None)


def _concurrent(args, precision: Precision) -> bool:
    """Whether `precision` runs the concurrencies above 1 (--concurrent-precisions)."""
    return args.quick or precision.name in args.concurrent_precisions


def bandwidth_fractions(by_concurrency: list, bytes_per_token: dict, bandwidth: float) -> dict:
    """At concurrency 1: bytes per token x decode tokens/s / the plain read's bytes/s."""
    single = at_concurrency(by_concurrency, 1)
    if not single:
        return {}
    return {
        name: bytes_per_token[name] * rate / (bandwidth * 1e9)
        for name, rate in single["decode_tokens_per_second"].items()
        if bytes_per_token.get(name)
    }


# --- models and peers ----------------------------------------------------------------------------


def activation_dtype(precision: Precision) -> str:
    """The precision's activations, float32 where the CPU has no native bf16."""
    return precision.dtype if plan.native_bf16() else "float32"


def ours_model(args, precision: Precision) -> tuple[Path, dict]:
    """The engine's model for `precision` and its LLMConfig settings."""
    from bench import real_size_models as models

    if args.quick:
        return args.quick_dir, {}
    settings = dict(precision.ours_settings) | _int8_activations(precision)
    if precision.ours == "hf":
        return models.hf_checkpoint(args.seed), settings
    if precision.ours == "w4a16":
        return models.w4a16_checkpoint(args.seed), settings
    return models.gguf_file(precision.ours.split(":")[1], args.seed), settings


def _int8_activations(precision: Precision) -> dict:
    """`w4a16_activations: int8` for the 4-bit rows run in float32 (no native bf16) where the int8
    dot runs: the peers quantize their activations there too (llama.cpp's Q4_0 dot takes Q8_0
    activations), and `auto` keeps float32's exact products. In bfloat16 `auto` already picks it."""
    from kernels.wna16_linear import wna16_int8_dot

    four_bit = precision.ours in ("w4a16", "gguf:Q4_0")
    if four_bit and activation_dtype(precision) == "float32" and wna16_int8_dot():
        return {"w4a16_activations": "int8"}
    return {}


def peer_models(args, precision: Precision) -> tuple[dict[str, Path], dict[str, str]]:
    """Each peer's model for `precision` (converted or written first when needed), and the
    peers without one (-> why)."""
    from bench import real_size_models as models

    paths, reasons = {}, {}
    if precision.openvino:
        found, failed = plan.converted_models(
            {"openvino_genai": precision.openvino}, models.hf_checkpoint(args.seed)
        )
        paths.update(found)
        reasons.update(failed)
    else:
        reasons["openvino_genai"] = f"OpenVINO GenAI has no {precision.name} model here"
    if precision.llama_cpp:
        paths["llama_cpp"] = models.gguf_file(precision.llama_cpp, args.seed)
    else:
        reasons["llama_cpp"] = f"llama.cpp runs GGUF types; {precision.name} is compared as q4_0"
    return paths, reasons


def load_peer(worker: PeerWorker, name: str, path, dtype: str, args) -> dict:
    if name == "openvino_genai":
        settings = {
            "max_num_batched_tokens": 2048,
            "max_num_seqs": max(args.concurrency),
            "kv_cache_gb": 4,
        }
    else:
        settings = {
            "n_ctx": args.prompt_tokens + args.output_tokens + 16,
            "n_batch": 512,
            # float32: a float32 KV cache, as the engine's (llama.cpp's default is float16).
            "kv_cache_type": "F32" if dtype == "float32" else None,
        }
    return worker.load(PEERS[name], path, dtype, **settings)


def peer_bytes(args, precision: Precision, worker, paths: dict) -> dict[str, int]:
    """The peers' weight bytes per decoded token, less the embedding: llama.cpp's GGUF tensors as
    stored; OpenVINO's IR weights as its CPU plugin reads them (bench.peers.worker)."""
    sizes = {}
    if "llama_cpp" in paths:
        import gguf

        reader = gguf.GGUFReader(paths["llama_cpp"])
        tensors = [t for t in reader.tensors if t.name != "token_embd.weight"]
        sizes["llama_cpp"] = sum(int(t.n_bytes) for t in tensors)
    if "openvino_genai" in paths:
        float_bytes = 2 if activation_dtype(precision) == "bfloat16" else 4
        try:
            answer = worker.call(
                "weight_bytes", path=str(paths["openvino_genai"]), float_bytes=float_bytes
            )
            sizes["openvino_genai"] = answer["bytes"]
        except PeerError as exc:
            progress(f"OpenVINO IR weight bytes: {exc}")
    return sizes


# --- the default benchmark model at one request --------------------------------------------------


def measure_small(args, threads: int, worker, small_dir: Path, ov_path) -> dict:
    """The engine benchmark's random Llama (FULL) in float32 at concurrency 1, against OpenVINO
    GenAI on its fp32 export: the engine's fixed cost per step, where weights are few."""
    import torch

    from tooling.checkpoints import FULL

    torch.set_num_threads(threads)
    progress(f"{threads} thread(s), the default benchmark model at one request")
    ours = OurEngine(small_dir, "float32", 1, _model_len(args))
    systems = Systems(ours, worker)
    workload = make_workload(1, args.prompt_tokens, args.output_tokens, FULL.vocab)
    reference, _ = ours.run(workload)
    excluded, agreements = {}, {}
    if ov_path is not None:
        try:
            load_peer(worker, "openvino_genai", ov_path, "float32", args)
            outputs, _ = worker.generate(
                PEERS["openvino_genai"], workload.prompts, workload.max_tokens
            )
            agreements["openvino_genai"] = agreement(reference, outputs)
            if agreements["openvino_genai"]["tokens"] == 1.0:
                systems.peers["openvino_genai"] = PEERS["openvino_genai"]
            else:
                excluded["openvino_genai"] = (
                    f"greedy tokens differ ({agreements['openvino_genai']})"
                )
        except PeerError as exc:
            excluded["openvino_genai"] = f"failed: {exc}"
    timed = time_concurrency(args, systems, 1, FULL.vocab)
    return {
        "threads": threads,
        "agreement_with_engine": agreements,
        "excluded": excluded,
        "concurrency": [timed],
    }


# --- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace, scratch: Path) -> dict:
    from bench import real_size_models as models
    from tooling.checkpoints import FULL, Sizes, build_random_llama

    device = cli.default_device(args.device)
    if device.type != "cpu":
        raise SystemExit("bench.real_sizes compares CPU systems: run it with --device cpu")
    # The engine's GGUF conversions are cached beside the models (pruned with them), not in
    # ~/.cache.
    os.environ["XDG_CACHE_HOME"] = str(models.CONVERSIONS)
    precisions, skipped = chosen_precisions(args)
    no_peers = plan.why_no_peers(args, device)
    if args.quick:
        args.quick_dir = scratch / "quick"
        build_random_llama(
            Sizes(**QUICK_SHAPE), args.quick_dir, args.seed, byte_level_tokenizer=True
        )
        args.vocab = QUICK_SHAPE["vocab"]
    else:
        args.vocab = models.SHAPE.vocab
    small_dir = scratch / "small"
    build_random_llama(FULL, small_dir, args.seed)
    runs, small_runs = [], []
    for threads in args.thread_counts:
        worker = None if no_peers else PeerWorker(threads)
        try:
            for precision in precisions:
                if worker and not worker.alive:  # a peer crashed it: the next gets a new one
                    worker.close()
                    worker = PeerWorker(threads)
                if no_peers:
                    paths, reasons = {}, dict.fromkeys(PEERS, no_peers)
                else:
                    paths, reasons = peer_models(args, precision)
                record = measure(args, precision, threads, worker, paths)
                record["excluded"] = {**reasons, **record["excluded"]}
                runs.append(record)
            if worker and not worker.alive:
                worker.close()
                worker = PeerWorker(threads)
            small_ov = None if no_peers else small_model_export(small_dir)
            small_runs.append(measure_small(args, threads, worker, small_dir, small_ov))
        finally:
            if worker:
                worker.close()
    summary, missing = summarize(runs, small_runs, skipped, no_peers)
    return {
        "device": "cpu",
        "dtype": ",".join(p.name for p in precisions),
        "model": {
            "shape": QUICK_SHAPE if args.quick else vars(models.SHAPE),
            "parameters": None if args.quick else models.parameters(args.seed),
        },
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.concurrency,
            "greedy": True,
            "ignore_eos": True,
        },
        "thread_counts": args.thread_counts,
        "repeats": args.repeats,
        "skipped_precisions": skipped,
        "peers": {"run": not no_peers, "reason": no_peers},
        "runs": runs,
        "small_model": {"runs": small_runs},
        "summary": summary,
        "missing": missing,
    }


def chosen_precisions(args) -> tuple[list[Precision], dict[str, str]]:
    """The precisions to run and those left out, with why."""
    names = ["f32"] if args.quick else args.precisions
    unknown = set(names) - set(PRECISIONS)
    if unknown:
        raise SystemExit(f"--precisions: unknown {sorted(unknown)}; known: {list(PRECISIONS)}")
    why = "--quick runs f32 only" if args.quick else f"not run: --precisions {','.join(names)}"
    skipped = {n: why for n in PRECISIONS if n not in names}
    chosen = []
    for name in names:
        if name == "bf16" and not plan.native_bf16():
            skipped[name] = plan.BF16_NOT_NATIVE
        else:
            chosen.append(PRECISIONS[name])
    return chosen, skipped


def small_model_export(small_dir: Path):
    found, _ = plan.converted_models({"openvino_genai": "openvino-llm"}, small_dir)
    return found.get("openvino_genai")


def plain_read_gb_per_s(threads: int) -> float:
    """What a plain read streams on `threads` threads, GB/s (bench.gemv_bandwidth)."""
    from bench.gemv_bandwidth import plain_read_gb_per_s as measured

    return measured(threads)


# --- summary and report --------------------------------------------------------------------------


def summarize(runs, small_runs, skipped, no_peers) -> tuple[dict, dict]:
    """Each KEYS figure (and SMALL_KEY) at its worst thread count; those not measured, with why."""
    summary, missing = {}, {}
    for prefix, names in KEYS.items():
        for name in names:
            key = f"{prefix}_{name}"
            values, why = [], None
            mine = [r for r in runs if r["precision"] == name]
            for record in mine:
                value, why_not = figure(prefix, record)
                if value is None:
                    why = why or why_not
                else:
                    values.append(value)
            if values and why is None:
                summary[key] = min(values)
            else:
                missing[key] = why or skipped.get(name) or no_peers or "not run"
    small = [
        _ratio(r["concurrency"][0], "decode_tokens_per_second", "openvino_genai")
        for r in small_runs
    ]
    if small and all(v is not None for v in small):
        summary[SMALL_KEY] = min(small)
    else:
        reasons = [r["excluded"].get("openvino_genai") for r in small_runs]
        missing[SMALL_KEY] = no_peers or next((w for w in reasons if w), "not run")
    return summary, missing


def figure(prefix: str, record: dict) -> tuple[float | None, str | None]:
    """One summary figure of one run, or None and why."""
    if prefix == "c1_bandwidth_fraction":
        value = record["bandwidth_fraction"].get("engine")
        return value, None if value is not None else "concurrency 1 not run"
    peer = "llama_cpp" if prefix.endswith("llama_cpp") else "openvino_genai"
    concurrency = 16 if prefix.startswith("c16") else 1
    timed = at_concurrency(record["concurrency"], concurrency)
    if timed is None:
        return None, f"concurrency {concurrency} not run"
    rate = "output_tokens_per_second" if concurrency > 1 else "decode_tokens_per_second"
    value = _ratio(timed, rate, peer)
    why = record["excluded"].get(peer, "not run") if value is None else None
    return value, why


def _ratio(timed: dict, rate: str, peer: str) -> float | None:
    rates = timed[rate]
    if peer not in rates or "engine" not in rates:
        return None
    ours, theirs = rates["engine"], rates[peer]
    if isinstance(ours, dict):
        ours, theirs = ours["median"], theirs["median"]
    return ours / theirs


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    work, model = result["workload"], result["model"]
    params = model["parameters"]
    size = f"{params / 1e9:.2f}B parameters" if params else "the --quick shape"
    lines = [
        f"Random Llama of Llama-3.2-1B's shape ({size}); each request {work['prompt_tokens']} "
        f"prompt tokens, {work['output_tokens']} greedy output tokens (EOS ignored); "
        f"{result['repeats']} interleaved repeat(s). Peers: "
        + (
            "in a worker of .venv-peers, same threads and token ids."
            if result["peers"]["run"]
            else f"not run ({result['peers']['reason']})."
        ),
        "",
        "| threads | precision | requests | system | output tokens/s | decode tokens/s | "
        "TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in result["runs"]:
        lead = f"| {record['threads']} | {record['precision']} |"
        lines += _rate_rows(lead, record["concurrency"])
    lines += [
        "",
        "| threads | precision | system | weight GB per token | bandwidth fraction | greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    for record in result["runs"]:
        for name, size in record["weight_bytes_per_token"].items():
            fraction = record["bandwidth_fraction"].get(name)
            check = record["agreement_with_engine"].get(name)
            lines.append(
                f"| {record['threads']} | {record['precision']} | {name} | {size / 1e9:.3f} | "
                f"{'' if fraction is None else f'{fraction:.2f}'} | "
                f"{'' if check is None else format(check['tokens'], '.0%') + ' tokens'} |"
            )
        for name, why in record["excluded"].items():
            if why:
                lines.append(
                    f"| {record['threads']} | {record['precision']} | {name} | not timed: {why} | | |"
                )
    lines += ["", "The default benchmark model (32.5M parameters, float32) at one request:", ""]
    lines += [
        "| threads | precision | requests | system | output tokens/s | decode tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for record in result["small_model"]["runs"]:
        lines += _rate_rows(f"| {record['threads']} | f32 |", record["concurrency"])
    plain = [
        f"{r['threads']} thread(s) {r['precision']} {r['plain_read_gb_per_s']:.1f}"
        for r in result["runs"]
        if r.get("plain_read_gb_per_s")
    ]
    lines += [
        "",
        "Plain read on the same threads, GB/s (before and after each precision's one-request "
        "timing): " + ", ".join(plain),
        "",
    ]
    return [*lines, *plan.summary_lines(result)]


def _rate_rows(lead: str, by_concurrency: list) -> list[str]:
    rows = []
    for timed in by_concurrency:
        concurrency = timed["requests"]
        for name, rate in timed["output_tokens_per_second"].items():
            decode = timed["decode_tokens_per_second"].get(name)
            ttft, tpot = timed["ttft_ms"][name], timed["tpot_ms"][name]
            rows.append(
                f"{lead} {concurrency} | {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | "
                f"{'' if decode is None else f'{decode:.1f}'} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
                f"{tpot['p50']:.1f} / {tpot['p99']:.1f} |"
            )
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    plan.add_args(parser)
    parser.set_defaults(concurrency=cli.ByMode(quick=[1, 4], cpu=[1, 4, 16, 64]))
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(n) for n in s.split(",")],
        help="requests in flight, each in turn (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrent-precisions",
        type=lambda s: [n for n in s.split(",") if n],
        default=["bf16", "int4"],
        help="the precisions that run the concurrencies above 1 (default: %(default)s, those "
        "of the c16 summary figures; the others run concurrency 1 only)",
    )
    parser.add_argument(
        "--precisions",
        type=lambda s: [n for n in s.split(",") if n],
        default=list(PRECISIONS),
        help=f"of {', '.join(PRECISIONS)} (default: all; bf16 only with native bf16)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=cli.ByMode(quick=16, cpu=128))
    parser.add_argument("--output-tokens", type=int, default=cli.ByMode(quick=8, cpu=64))


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
