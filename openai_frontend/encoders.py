"""Calls to the encoder models (embedding, rerank), split to fit Triton's max_batch_size."""

from __future__ import annotations

import asyncio

import numpy as np

from openai_frontend.discovery import ModelInfo
from openai_frontend.triton import TritonClient


def _column(texts: list[str]) -> np.ndarray:
    return np.array([[t.encode("utf-8")] for t in texts], dtype=object)


def _batches(count: int, size: int) -> list[slice]:
    size = size if size > 0 else max(count, 1)
    return [slice(start, start + size) for start in range(0, count, size)]


async def embed(triton: TritonClient, info: ModelInfo, texts: list[str]) -> np.ndarray:
    """[len(texts), dim] float32 vectors, in input order."""
    parts = await asyncio.gather(
        *(
            triton.infer(info.name, {"text_input": _column(texts[s])}, ["embedding"])
            for s in _batches(len(texts), info.max_batch_size)
        )
    )
    return np.concatenate([p["embedding"] for p in parts]).astype(np.float32)


async def score(triton: TritonClient, info: ModelInfo, pairs: list[tuple[str, str]]) -> list[float]:
    """The rerank model's score of each (query, document) pair, in order."""
    parts = await asyncio.gather(
        *(
            triton.infer(
                info.name,
                {
                    "query": _column([q for q, _ in pairs[s]]),
                    "document": _column([d for _, d in pairs[s]]),
                },
                ["score"],
            )
            for s in _batches(len(pairs), info.max_batch_size)
        )
    )
    return [float(v) for p in parts for v in p["score"].reshape(-1)]
