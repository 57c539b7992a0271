"""What a benchmark says and writes: progress lines, the machine it ran on, its JSON result."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays for results), flushed at once."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def duration_text(seconds: float) -> str:
    """Wall time as read by a person: "48 s", "32 min 10 s", "1 h 02 min"."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def machine_info() -> dict[str, object]:
    """CPU / GPU, threads, load and library versions, for reading the figures later."""
    import torch

    info: dict[str, object] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min
        "versions": library_versions(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def library_versions() -> dict[str, str]:
    import numpy as np
    import tokenizers
    import torch
    import transformers

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }
    for module in ("sentence_transformers", "triton", "tritonclient"):
        with contextlib.suppress(ImportError, AttributeError):
            versions[module] = __import__(module).__version__
    return versions


def write_result(path: Path, result: dict) -> None:
    """Write one benchmark's result as indented JSON (NaN refused: results must be valid JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")
