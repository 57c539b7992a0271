"""The OpenAI frontend as a subprocess on a free port (`python -m openai_frontend`), as a test
starts it in front of a tritonserver."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tooling.child_process import die_with_parent
from tooling.tritonserver import TritonServer, free_port, http_status

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Frontend:
    url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-80:])


def start_frontend(triton_url: str, repository: Path, *extra_args: str) -> Frontend:
    """`python -m openai_frontend` on a free port in front of `triton_url`, once it answers."""
    port = free_port()
    handle, log_name = tempfile.mkstemp(prefix="openai-frontend-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "TRITON_ADMIN_KEY")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openai_frontend",
            "--triton-url",
            triton_url,
            "--model-repository",
            str(repository),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra_args,
        ],
        cwd=REPO_ROOT,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=die_with_parent(),
    )
    os.close(handle)
    front = Frontend(f"http://127.0.0.1:{port}", process, Path(log_name))
    deadline = time.monotonic() + 60
    while http_status(f"{front.url}/health") != 200:
        assert process.poll() is None and time.monotonic() < deadline, front.log_tail()
        time.sleep(0.2)
    return front


def stop_frontend(front: Frontend) -> None:
    front.process.terminate()
    front.process.wait(timeout=30)


@contextmanager
def served_repository(repository: Path) -> Iterator[Frontend]:
    """A real tritonserver on `repository` and a frontend before it, both stopped on exit."""
    with served_with_server(repository) as (_, front):
        yield front


@contextmanager
def served_with_server(repository: Path) -> Iterator[tuple[TritonServer, Frontend]]:
    """`served_repository`, with the tritonserver too (for calls to Triton itself)."""
    from tests.server_helpers import start_server, stop_server

    server = start_server(repository)
    try:
        front = start_frontend(server.grpc_url, repository)
        try:
            yield server, front
        finally:
            stop_frontend(front)
    finally:
        stop_server(server)


def cosine(a, b) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] arrays."""
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
