"""A tritonserver for the served benchmarks, started on a repository they wrote."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from bench.output import progress


def instance_kind(device) -> str:
    """The config.pbtxt instance kind that puts a model on `device`."""
    return "KIND_GPU" if device.type == "cuda" else "KIND_CPU"


@contextlib.contextmanager
def tritonserver(repository: Path, threads: int) -> Iterator[tuple[object, float]]:
    """A ready tritonserver serving `repository`, and the seconds it took to get ready.

    `threads` (unless 0) becomes the server's OMP_NUM_THREADS: torch in the Python-backend stub
    reads it when it starts, so the served side runs with the thread count of the direct side."""
    from tooling.tritonserver import TritonServer

    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    started = time.perf_counter()
    with TritonServer(repository, env=env) as server:
        while not server.is_ready():
            time.sleep(0.2)
        start_seconds = time.perf_counter() - started
        progress(f"tritonserver ready after {start_seconds:.1f} s")
        yield server, start_seconds
