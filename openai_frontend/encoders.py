"""Calls to the encoder models (embedding, rerank), split to fit Triton's max_batch_size. Each call
also returns the tokens the model computed (its `num_input_tokens`, after truncation): the usage.
A request's `priority` (lower first) goes to the model as its `priority` input, and the client's
`x-request-timeout` header (deadline.py) as the Triton request's timeout: the model's micro-batch
scheduler serves by both (backend_lib/encoder/scheduler.py)."""

from __future__ import annotations

import asyncio

import numpy as np

from backend_lib import contract
from openai_frontend import deadline
from openai_frontend.discovery import ModelInfo
from openai_frontend.triton import TritonClient

EmbeddingItems = list[str] | list[list[int]] | list[bytes]
"""What an embedding model embeds: texts, token-id items, or encoded images (an image-text
checkpoint's)."""


def _column(values: list[str] | list[bytes]) -> np.ndarray:
    """[N, 1] BYTES rows: texts as UTF-8, bytes (encoded images) as they are."""
    return np.array(
        [[v.encode("utf-8") if isinstance(v, str) else v] for v in values], dtype=object
    )


def _batches(count: int, size: int) -> list[slice]:
    size = size if size > 0 else max(count, 1)
    return [slice(start, start + size) for start in range(0, count, size)]


def _tokens(parts: list[dict[str, np.ndarray | None]]) -> int:
    """The tokens the model reports for every row (0 for a model that reports none)."""
    counts = [p.get(contract.NUM_INPUT_TOKENS) for p in parts]
    return sum(int(c.sum()) for c in counts if c is not None)


def _per_request(inputs: dict[str, np.ndarray], options: dict[str, str | int | bool]) -> dict:
    """`inputs` plus each option (`prompt_name`, `dimensions`, `normalize`, `truncate`) repeated
    for every row."""
    rows = len(next(iter(inputs.values())))
    for name, value in options.items():
        if isinstance(value, str):
            inputs[name] = _column([value] * rows)
        elif isinstance(value, bool):
            inputs[name] = np.full((rows, 1), value, dtype=bool)
        else:
            inputs[name] = np.full((rows, 1), value, dtype=np.int32)
    return inputs


def _embedding_requests(
    items: EmbeddingItems, max_batch_size: int, options: dict[str, str | int | bool]
) -> list[tuple[list[int], dict[str, np.ndarray]]]:
    """(item positions, inputs) of each Triton request: texts (`text_input`) or encoded images
    (`image`) in batches, token-id items grouped by length (one request holds [N, L] ids);
    `options` go to every request."""
    if isinstance(items[0], (str, bytes)):
        name = contract.TEXT_INPUT if isinstance(items[0], str) else contract.IMAGE
        return [
            (list(range(len(items)))[s], _per_request({name: _column(items[s])}, options))
            for s in _batches(len(items), max_batch_size)
        ]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(items):
        by_length.setdefault(len(ids), []).append(i)
    requests = []
    for positions in by_length.values():
        for s in _batches(len(positions), max_batch_size):
            rows = positions[s]
            ids = np.array([items[i] for i in rows], dtype=np.int64)
            requests.append((rows, _per_request({contract.INPUT_IDS: ids}, options)))
    return requests


async def embed(
    triton: TritonClient,
    info: ModelInfo,
    items: EmbeddingItems,
    prompt_name: str | None = None,
    dimensions: int | None = None,
    *,
    normalize: bool | None = None,
    truncate: bool | None = None,
    priority: int = 0,
) -> tuple[np.ndarray, int]:
    """[len(items), dim] float32 vectors of texts, token-id items or encoded images, in input
    order, and the tokens embedded; `prompt_name` and `dimensions` go to the model as they are (it checks them);
    `normalize` and `truncate` (texts only) as the model's BOOL inputs, None: the model's default."""
    outputs = [contract.EMBEDDING, contract.NUM_INPUT_TOKENS]
    options = _options(
        {
            contract.PROMPT_NAME: prompt_name,
            contract.DIMENSIONS: dimensions,
            contract.NORMALIZE: normalize,
            contract.TRUNCATE: truncate,
            contract.PRIORITY: priority or None,
        }
    )
    parts, order = await _infer_items(triton, info, items, options, outputs)
    vectors = np.concatenate([p[contract.EMBEDDING] for p in parts]).astype(np.float32)
    return vectors[order], _tokens(parts)


async def embed_sparse(
    triton: TritonClient,
    info: ModelInfo,
    texts: list[str],
    prompt_name: str | None = None,
    truncate: bool | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """A sparse embedding model's (vocabulary ids, weights) of each text, in input order (ids
    ascending, the model's padding dropped), and the tokens embedded; `prompt_name` and
    `truncate` as for `embed`."""
    outputs = [contract.INDICES, contract.VALUES, contract.NUM_INPUT_TOKENS]
    options = _options({contract.PROMPT_NAME: prompt_name, contract.TRUNCATE: truncate})
    parts, order = await _infer_items(triton, info, texts, options, outputs)
    rows = [
        (ids[ids != contract.SPARSE_PAD_INDEX], weights[ids != contract.SPARSE_PAD_INDEX])
        for part in parts
        for ids, weights in zip(part[contract.INDICES], part[contract.VALUES], strict=True)
    ]
    return [rows[i] for i in order], _tokens(parts)


def _options(values: dict[str, str | int | bool | None]) -> dict[str, str | int | bool]:
    """The options a request sets (None: the model's default, not sent)."""
    return {name: value for name, value in values.items() if value is not None}


async def _infer_items(
    triton: TritonClient,
    info: ModelInfo,
    items: EmbeddingItems,
    options: dict[str, str | int | bool],
    outputs: list[str],
) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """The `outputs` of each Triton request the items take (`_embedding_requests`), sent
    concurrently, and the order that puts their concatenated rows back in input order."""
    requests = _embedding_requests(items, info.max_batch_size, options)
    timeout_us = _timeout_us()
    parts = await asyncio.gather(
        *(
            triton.infer(info.name, inputs, outputs, info.version, timeout_us)
            for _, inputs in requests
        )
    )
    return parts, np.argsort(np.concatenate([rows for rows, _ in requests]), kind="stable")


def _timeout_us() -> int | None:
    """The client's `x-request-timeout` as a Triton request timeout (None: none)."""
    milliseconds = deadline.deadline_ms()
    return None if milliseconds is None else max(1, round(milliseconds * 1000))


async def score(
    triton: TritonClient, info: ModelInfo, pairs: list[tuple[str, str]], priority: int = 0
) -> tuple[list[float], int]:
    """The rerank model's score of each (query, document) pair, in order, and the tokens scored."""
    outputs = [contract.SCORE, contract.NUM_INPUT_TOKENS]
    options = _options({contract.PRIORITY: priority or None})
    timeout_us = _timeout_us()
    parts = await asyncio.gather(
        *(
            triton.infer(
                info.name,
                _per_request(
                    {
                        contract.QUERY: _column([q for q, _ in pairs[s]]),
                        contract.DOCUMENT: _column([d for _, d in pairs[s]]),
                    },
                    options,
                ),
                outputs,
                info.version,
                timeout_us,
            )
            for s in _batches(len(pairs), info.max_batch_size)
        )
    )
    return [float(v) for p in parts for v in p[contract.SCORE].reshape(-1)], _tokens(parts)
