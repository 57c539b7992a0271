"""Token-budget micro-batching of encoder work.

Items (texts or query-document pairs) are sorted by length, longest first, and packed
greedily into micro-batches bounded by padded tokens (items x longest item) and by item
count. Similar lengths end up together, so batches are full and, for the packed encoder,
sequences of equal length form long attention runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class MicroBatch:
    """What one micro-batch did: its item indices, padded-token bound, real tokens, time."""

    indices: list[int]
    padded_tokens: int
    real_tokens: int
    seconds: float


def plan_micro_batches(
    lengths: list[int], max_batch_tokens: int, max_batch_size: int
) -> list[list[int]]:
    """Group item indices into micro-batches, longest items first.

    Each batch has at most `max_batch_size` items and `len(batch) * longest <=
    max_batch_tokens`; an item longer than the budget alone gets a batch of its own.
    Every index appears in exactly one batch; within a batch, lengths do not increase.
    """
    if max_batch_tokens < 1 or max_batch_size < 1:
        raise ValueError("max_batch_tokens and max_batch_size must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # Longest-first: the batch's first item is its longest.
        longest = lengths[current[0]] if current else lengths[index]
        if current and (
            len(current) >= max_batch_size or (len(current) + 1) * longest > max_batch_tokens
        ):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def run_micro_batches(
    lengths: Sequence[int],
    max_batch_tokens: int,
    max_batch_size: int,
    compute: Callable[[list[int]], np.ndarray],
    out: np.ndarray,
) -> list[MicroBatch]:
    """Plan the items, call `compute(indices)` per micro-batch and write each result row
    to `out[index]`, so results come back in input order."""
    report = []
    for indices in plan_micro_batches(list(lengths), max_batch_tokens, max_batch_size):
        started = time.perf_counter()
        out[indices] = compute(indices)
        batch_lengths = [lengths[i] for i in indices]
        report.append(
            MicroBatch(
                indices=indices,
                padded_tokens=len(indices) * max(batch_lengths),
                real_tokens=sum(batch_lengths),
                seconds=time.perf_counter() - started,
            )
        )
    return report
