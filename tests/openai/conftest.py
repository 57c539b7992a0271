"""One OpenAI frontend per session (a subprocess on a free port) in front of the session-wide
tritonserver, and a second in-process app with an API key for the auth checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from tests.openai.frontend_helpers import REPO_ROOT, Frontend, start_frontend, stop_frontend
from tests.openai.references import API_KEY
from tooling.tritonserver import TritonServer, free_port


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
