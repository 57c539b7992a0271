"""One OpenAI frontend per session (a subprocess on a free port) in front of the session-wide
tritonserver, and a second in-process app with an API key for the auth checks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from tests.openai.references import API_KEY
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


@pytest.fixture(scope="session")
def frontend(server: TritonServer) -> Iterator[Frontend]:
    front = start_frontend(
        server.grpc_url, REPO_ROOT / "model_repository", "--max-body-bytes", "65536"
    )
    yield front
    stop_frontend(front)


@pytest.fixture
def make_frontend() -> Iterator[Callable[..., Frontend]]:
    """Factory: a frontend subprocess (`start_frontend`'s arguments), stopped after the test."""
    started: list[Frontend] = []

    def factory(triton_url: str, repository: Path, *extra_args: str) -> Frontend:
        front = start_frontend(triton_url, repository, *extra_args)
        started.append(front)
        return front

    yield factory
    for front in started:
        stop_frontend(front)


@pytest.fixture(scope="session")
def client(frontend: Frontend) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=frontend.url, timeout=120) as http:
        yield http


def in_process_client(triton_url: str, **settings) -> TestClient:
    """A frontend app in this process (FastAPI's TestClient: the app runs on its own loop)."""
    config = FrontendConfig(
        triton_url=triton_url, model_repository=REPO_ROOT / "model_repository", **settings
    )
    return TestClient(create_app(config), raise_server_exceptions=False)


@pytest.fixture(scope="session")
def keyed_client(server: TritonServer) -> TestClient:
    """A second frontend that requires API_KEY."""
    return in_process_client(server.grpc_url, api_key=API_KEY)


@pytest.fixture(scope="session")
def unreachable_client() -> TestClient:
    """A frontend whose tritonserver does not answer."""
    return in_process_client(f"127.0.0.1:{free_port()}")
