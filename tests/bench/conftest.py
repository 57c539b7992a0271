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

import pytest

from tests.bench.checks import REPO_ROOT, SuiteRun


@pytest.fixture(scope="session")
def quick_suite(tmp_path_factory) -> SuiteRun:
    """The whole suite in --quick mode; a failing benchmark fails its own tests, not all."""
    out_dir = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out-dir", str(out_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        # CPU whatever the machine: float32 on CPU requires identical greedy outputs.
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    return SuiteRun(out_dir, proc.returncode, proc.stderr)
