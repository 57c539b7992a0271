"""Shared pieces of the benchmark scripts: timing statistics, machine facts, result files, progress.

Every benchmark script under scripts/ exposes `parse_args(argv)`, `run(args) -> dict` and `main(argv)`,
accepts `--quick` (tiny sizes, for `make test`) and `--out PATH` (its JSON result), and records
`machine_info()` in that result. `scripts/bench_suite.py` runs them all and writes the summary.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


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


def time_repeats(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Time each function `repeats` times, interleaved (a, b, a, b, ...), so background load hits
    all alike."""
    timings = {name: Timing([]) for name in functions}
    for rep in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            timings[name].seconds.append(time.perf_counter() - started)
            progress(f"repeat {rep + 1}/{repeats} {name}: {timings[name].seconds[-1]:.2f} s")
    return timings


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


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays for results), flushed at once."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine_info() -> dict[str, object]:
    """CPU / GPU, threads, load and library versions, for reading the figures later."""
    import numpy as np
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
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }
    for module in ("sentence_transformers", "triton", "tritonclient"):
        with contextlib.suppress(ImportError, AttributeError):
            versions[module] = __import__(module).__version__
    info: dict[str, object] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min
        "versions": versions,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def bench_main(
    parse_args: Callable, run: Callable, report: Callable, argv: list[str] | None = None
) -> dict:
    """A benchmark script's `main`: parse its arguments, run it, print its report section and
    write its JSON result to `--out`."""
    args = parse_args(argv)
    result = run(args)
    print("\n".join(report(result)))
    write_result(args.out, result)
    return result


def write_result(path: Path, result: dict) -> None:
    """Write one benchmark's result as indented JSON (NaN refused: results must be valid JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
