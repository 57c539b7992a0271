"""What the embedding and rerank benchmarks share: their inputs (mixed-length texts, query-document
pairs), the sentence-transformers references, and how outputs are compared with them."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

from tooling.checkpoints import MINILM_SPEC

DEFAULT_MODEL = MINILM_SPEC
DOCUMENTS_PER_QUERY = 8
DOCUMENT_WORDS = 100
"""Documents are passage-sized: mixed_texts cut to at most this many words."""

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


def rerank_pairs(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`count` (query, document) pairs: short queries (2-12 words), each with
    DOCUMENTS_PER_QUERY documents of mixed length (mixed_texts, at most DOCUMENT_WORDS words)."""
    rng = random.Random(seed)
    num_queries = -(-count // DOCUMENTS_PER_QUERY)
    queries = [
        " ".join(text.split()[: rng.randint(2, 12)]) for text in mixed_texts(num_queries, seed + 1)
    ]
    documents = [" ".join(text.split()[:DOCUMENT_WORDS]) for text in mixed_texts(count, seed)]
    return [queries[i // DOCUMENTS_PER_QUERY] for i in range(count)], documents


def reference_model(cls, model_dir: Path, device, dtype):
    """A sentence-transformers `SentenceTransformer` or `CrossEncoder` on the checkpoint."""
    return cls(
        str(model_dir), device=str(device), local_files_only=True, model_kwargs={"dtype": dtype}
    )


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def max_score_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Largest absolute difference, relative to max(1, largest |reference|)."""
    return float(np.abs(ours - reference).max() / max(1.0, float(np.abs(reference).max())))


def cosine_gate(dtype) -> float:
    """The least cosine an embedding may have with the reference's: float32 or 16-bit."""
    import torch

    return 0.9999 if dtype == torch.float32 else 0.99


def add_min_cosine_flag(parser: argparse.ArgumentParser) -> None:
    """--min-cosine: the embeddings' fidelity gate, when not `cosine_gate`'s."""
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        help="embedding fidelity gate (default: 0.9999 for float32, 0.99 for 16-bit dtypes)",
    )


def score_tolerance(dtype) -> float:
    """The largest relative error a rerank score may have against the reference's."""
    import torch

    return 1e-3 if dtype == torch.float32 else 5e-2


def rate_rows(result: dict, systems: tuple[str, ...]) -> list[str]:
    """Report table of each system's items/s and tokens/s."""
    lines = ["| system | items/s median (min-max) | tokens/s median |", "|---|---|---|"]
    for name in systems:
        r = result["items_per_second"][name]
        lines.append(
            f"| {name} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
            f"{result['tokens_per_second'][name]['median']:.0f} |"
        )
    return lines
