"""Shared fixtures: a real tritonserver (session-wide on the default repository, or per test on a
temporary one), whose log goes in the report of a test failing while it runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Triton-language kernels run through the interpreter when no GPU is present. Must be set before
# the first `import triton` anywhere in the session.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.sampling import unsampled  # noqa: E402
from tests.server_helpers import (  # noqa: E402
    DEFAULT_REPOSITORY,
    live_servers,
    start_server,
    stop_server,
)
from tooling.tritonserver import TritonServer  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/e2e/conftest.py: a root conftest's options work with any test path
    # (`make test PYTEST_ARGS="--soak-seconds 600"`).
    parser.addoption(
        "--soak-seconds",
        type=float,
        default=60.0,
        help="how long tests/e2e/test_soak.py sends mixed traffic (default 60)",
    )


SERVER_FIXTURES = {"server", "make_server", "reliability_server"}
"""Fixtures that start a tritonserver: a test using one must be marked e2e (`make test-fast`
deselects e2e tests and must never start a server)."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the slow marks below must be seen
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in unsampled(items):
        item.add_marker(pytest.mark.slow)
    unmarked = [
        item.nodeid
        for item in items
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that start a tritonserver must be marked e2e: " + ", ".join(unmarked)
        )


# Under `pytest -n 2` (make test), tests sharing a session-wide server or the one benchmark run
# stay on one worker, so each starts once; every other test is its own work unit.
WORKER_GROUPS = {
    "tests/bench/": "bench",
    "tests/e2e/test_reliability.py": "reliability_server",
    "tests/e2e/test_soak.py": "reliability_server",
    "tests/e2e/test_llm.py": "server",
    "tests/e2e/test_llm_structured_outputs.py": "server",
    "tests/e2e/test_llm_compile_off_path.py": "server",
    "tests/e2e/test_llm_lora.py": "server",
    "tests/e2e/test_encoders.py": "server",
    "tests/e2e/test_metrics_from_load.py": "server",
    "tests/openai/": "server",
    "tests/deploy/test_queries_live.py": "prometheus",
    "tests/deploy/test_autoscaling_live.py": "prometheus",
}


def worker_group(nodeid: str) -> str:
    """The work unit of a test: its group, else its module for e2e tests (they share servers they
    start per module), else the test itself."""
    for prefix, group in WORKER_GROUPS.items():
        if nodeid.startswith(prefix):
            return group
    module = nodeid.split("::", 1)[0]
    return module if module.startswith("tests/e2e/") else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    # pytest-xdist's own --dist loadgroup does not apply its groups under pytest 9.
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return GroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # While the failed call's servers still run (a test's own make_server ones stop in its
    # teardown): their log tails go in the report.
    if report.when == "call" and report.failed:
        for server in live_servers:
            report.sections.append(
                (f"tritonserver log ({server.repository}), last lines", server.log_tail(150))
            )


@pytest.fixture(scope="session")
def server() -> Iterator[TritonServer]:
    """One tritonserver on the default repository, shared by all end-to-end tests."""
    srv = start_server(DEFAULT_REPOSITORY)
    yield srv
    stop_server(srv)


@pytest.fixture
def make_server() -> Iterator[Callable[..., TritonServer]]:
    """Factory: start a tritonserver on another repository; stopped at the end of the test."""
    started: list[TritonServer] = []

    def factory(repository: Path, extra_args=(), env=None) -> TritonServer:
        srv = start_server(repository, extra_args, env)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        stop_server(srv)
