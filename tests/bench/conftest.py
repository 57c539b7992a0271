"""The benchmark suite runs once per test session (`python -m bench --quick`, on CPU, one torch
thread) into a temp dir; the tests here assert on what it wrote. Two of its benchmarks run
through a real tritonserver.

Only that each benchmark runs, checks its systems' outputs against each other and writes
well-formed, self-consistent results is asserted: quick sizes make the figures meaningless, and
timed figures never decide a test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.checks import REPO_ROOT, SuiteRun

SUITE_TIMEOUT_S = 1500
"""How long the quick suite may run (the first benchmark test pays for it)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The suite runs inside a test's setup: past the session default (pyproject.toml), and
    # bounded by its own subprocess timeout before pytest-timeout's.
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.timeout(SUITE_TIMEOUT_S + 300))


@pytest.fixture(scope="session")
def quick_suite(tmp_path_factory) -> SuiteRun:
    """The whole suite in --quick mode; a failing benchmark fails its own tests, not all."""
    out_dir = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out-dir", str(out_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        # CPU whatever the machine: float32 on CPU requires identical greedy outputs.
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    return SuiteRun(out_dir, proc.returncode, proc.stderr)
