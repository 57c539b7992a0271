"""`make bench` in quick mode: every benchmark runs and the suite writes valid results.

Only that it runs and writes well-formed results is asserted: quick sizes make the figures
meaningless, and timed figures never decide a test. Each benchmark's own checks (outputs of the
compared systems agree before timing) still run and fail the suite when violated.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_suite import BENCHMARKS, TARGETS  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "scripts/bench_suite.py", "--quick", "--out-dir", str(out_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        for log in sorted(out_dir.glob("*.log")):
            print(f"===== {log.name} =====\n{log.read_text()[-4000:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out_dir


def test_summary_holds_every_headline_figure(quick_suite):
    summary = json.loads((quick_suite / "summary.json").read_text())
    assert summary["failed"] == {}
    for target in TARGETS:
        value = summary[target.key]
        assert isinstance(value, float) and math.isfinite(value), target.key
    assert summary["quick"] is True
    assert {"torch", "transformers"} <= set(summary["versions"])
    assert summary["machine"]["cpu_count"] >= 1


def test_every_benchmark_wrote_its_result_and_report_section(quick_suite):
    report = (quick_suite / "report.md").read_text()
    assert "report() failed" not in report
    for bench in BENCHMARKS:
        result = json.loads((quick_suite / f"{bench.name}.json").read_text())
        assert result["quick"] is True, bench.name
        assert "machine" in result, bench.name
    for target in TARGETS:
        assert f"`{target.key}`" in report
    plots = list(quick_suite.glob("*.png"))
    assert plots, "no plots written"
    for png in plots:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png.name
        assert f"]({png.name})" in report, png.name
