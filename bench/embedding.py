"""Direct embedding throughput: `Embedder.encode` against `SentenceTransformer.encode`.

Same model, dtype, device and texts, in one process. Both systems must give the same
embeddings (min cosine over all texts >= --min-cosine) before anything is timed; then the
two are timed alternately, so background load hits both alike. Writes items/s and tokens/s
(min/median/max over the repeats) and the ratio, plus machine info and versions, as JSON.

    python -m bench.embedding [--quick] [--texts 2000] [--dtype float32] [--repeats 3]
                              [--out bench/results/embedding.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict
from pathlib import Path

from bench import cli
from bench.encoders import (
    DEFAULT_MODEL,
    add_min_cosine_flag,
    cosine_gate,
    min_cosine,
    mixed_texts,
    rate_rows,
    reference_model,
)
from bench.output import machine_info, progress
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import rates, time_repeats

NAME = "embedding"
HEADING = "Embedding (direct): Embedder vs SentenceTransformer.encode"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
TARGET_RATIO = target("embedding_vs_sentence_transformers")


KEY = "embedding_vs_sentence_transformers"


def run(args: argparse.Namespace, _scratch: Path) -> dict[str, object]:
    from backend_lib.checkpoint import resolve_model_path

    return run_with(args, resolve_model_path(args.model, Path.cwd()), args.model, KEY)


def run_with(args: argparse.Namespace, model_dir: Path, model: str, key: str) -> dict[str, object]:
    """The measurement on checkpoint `model_dir` (described as `model`), its ratio as `key`."""
    import torch
    from sentence_transformers import SentenceTransformer

    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    device, dtype, dtype_name = cli.setup_torch(args)
    texts = mixed_texts(args.texts, args.seed)
    reference = reference_model(SentenceTransformer, model_dir, device, dtype)
    config = EmbeddingConfig(model=str(model_dir), dtype=dtype_name)
    embedder = Embedder.from_config(config, device, Path.cwd())

    # Fidelity first (this also warms both up).
    gate = args.min_cosine or cosine_gate(dtype)
    cosine = min_cosine(embedder.encode(texts), reference.encode(texts))
    progress(f"min cosine over {len(texts)} texts: {cosine:.7f}")
    if cosine < gate:
        raise SystemExit(f"embeddings differ: min cosine {cosine:.7f} < {gate}")

    lengths = [len(t) for t in embedder.tokenize(texts)]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    timings = time_repeats(
        {
            "sentence_transformers": lambda: reference.encode(texts),
            "embedder": lambda: embedder.encode(texts),
        },
        args.repeats,
    )
    st_time, our_time = timings["sentence_transformers"], timings["embedder"]
    ratios = [a / b for a, b in zip(st_time.seconds, our_time.seconds, strict=True)]
    tokens = sum(lengths)
    return {
        "model": model,
        "device": str(device),
        "dtype": dtype_name,
        "texts": len(texts),
        "seed": args.seed,
        "tokens": {
            "total": tokens,
            "mean": tokens / len(lengths),
            "at_max_seq_length": sum(n == embedder.max_seq_length for n in lengths),
        },
        "fidelity": {"min_cosine": cosine, "gate": gate, "passed": True},
        "repeats": args.repeats,
        **rates(timings, len(texts), tokens),
        "ratio": st_time.min / our_time.min,
        "ratio_median": st_time.median / our_time.median,
        "ratio_per_repeat": ratios,
        "machine": {**machine_info(), "load_average_before_timing": load_before},
        "settings": {
            "embedder": asdict(config),
            "sentence_transformers": "encode() defaults (batch_size=32)",
            "torch_threads": torch.get_num_threads(),
        },
        "summary": {key: statistics.median(ratios)},
    }


def report(result: dict) -> list[str]:
    ratio = result["summary"]["embedding_vs_sentence_transformers"]
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    return [
        f"{result['texts']} mixed-length texts (mean {result['tokens']['mean']:.0f} tokens, "
        f"{result['tokens']['at_max_seq_length']} truncated), all-MiniLM-L6-v2, {result['dtype']} "
        f"on {result['device']}, tokenization included, {result['repeats']} interleaved repeats. "
        f"Embeddings checked first: min cosine {result['fidelity']['min_cosine']:.7f} "
        f"(gate {result['fidelity']['gate']}).",
        "",
        *rate_rows(result, ("sentence_transformers", "embedder")),
        "",
        f"Target: >= {TARGET_RATIO}x SentenceTransformer.encode: {ratio:.2f}x ({met}).",
        "",
    ]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(texts=cli.ByMode(quick=32, cpu=2000))
    parser.add_argument("--texts", type=int, help="how many texts (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    add_min_cosine_flag(parser)


# No plot: two numbers, the table reads better.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
