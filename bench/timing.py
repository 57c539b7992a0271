"""Timing: repeated runs interleaved across the compared systems, and their statistics.

Systems always run interleaved (a, b, a, b, ...), never all repeats of one then the other, so
background load on a shared machine hits every system alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from bench.output import progress

T = TypeVar("T")


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
        return {"min": items / self.max, "median": items / self.median, "max": items / self.min}


def timed(function: Callable[[], T]) -> Callable[[], tuple[T, float]]:
    """`function` made to return (its result, the seconds it took)."""

    def run() -> tuple[T, float]:
        started = time.perf_counter()
        result = function()
        return result, time.perf_counter() - started

    return run


def time_repeats(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Time each function `repeats` times, interleaved in a fixed order (a, b, a, b, ...)."""
    timings = {name: Timing([]) for name in functions}
    for rep in range(repeats):
        for name, function in functions.items():
            _, seconds = timed(function)()
            timings[name].seconds.append(seconds)
            progress(f"repeat {rep + 1}/{repeats} {name}: {seconds:.2f} s")
    return timings


def rates(timings: dict[str, Timing], items: int, tokens: int) -> dict[str, dict]:
    """Each system's seconds, and the items/s and tokens/s they give (min/median/max)."""
    return {
        "seconds": {name: t.seconds for name, t in timings.items()},
        "items_per_second": {name: t.items_per_second(items) for name, t in timings.items()},
        "tokens_per_second": {name: t.items_per_second(tokens) for name, t in timings.items()},
    }


def time_interleaved(
    systems: dict[str, Callable[[], tuple[T, float]]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, T]]:
    """Run systems that time themselves (each returns (outputs, seconds)) `repeats` times, in an
    order rotating every repeat; their seconds, and each one's outputs of the last repeat."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, T] = {}
    names = list(systems)
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            outputs[name], elapsed = systems[name]()
            seconds[name].append(elapsed)
            progress(f"repeat {rep + 1}/{repeats} {name}: {elapsed:.2f} s")
    return seconds, outputs


def spread(values: Sequence[float]) -> dict[str, float]:
    """{"min", "median", "max"} of repeated measurements."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation, as numpy's default; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def p50_p99_ms(values: Sequence[float]) -> dict[str, float]:
    """{"p50", "p99"} in milliseconds of values in seconds."""
    return {"p50": percentile(values, 50) * 1e3, "p99": percentile(values, 99) * 1e3}
