"""Plot helpers: matplotlib without a display, saving a figure, a CDF's points, bars of spreads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, dpi: int = 120) -> Path:
    """Write `fig` as a PNG (trimmed to its content) and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return path


def cdf(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF's points: sorted values and the share of values up to each."""
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def medians_and_errors(
    spreads: Iterable[Mapping[str, float]],
) -> tuple[list[float], list[list[float]]]:
    """Bar heights and error bars (matplotlib's two-row `yerr`) of {"min", "median", "max"}
    spreads: each median, and how far below and above it the min and max lie."""
    spreads = list(spreads)
    medians = [s["median"] for s in spreads]
    below = [s["median"] - s["min"] for s in spreads]
    above = [s["max"] - s["median"] for s in spreads]
    return medians, [below, above]
