"""`make bench` in quick mode: every benchmark runs and the suite writes summary.json and a report
holding every headline figure, each benchmark's section and its plots."""

from __future__ import annotations

import json
import math

import pytest

from bench.__main__ import BENCHMARKS
from bench.summary import TARGETS
from tests.bench.checks import OTHER_PEER_KEYS, PEER_KEYS, PNG_MAGIC, load_result

pytestmark = pytest.mark.bench


def test_summary_holds_every_headline_figure(quick_suite):
    assert quick_suite.returncode == 0, quick_suite.stderr[-4000:]
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    assert summary["failed"] == {}
    # Quick mode builds no peer environment: the peer figures are missing, each with its reason.
    peer_keys = set().union(*PEER_KEYS.values(), *OTHER_PEER_KEYS.values())
    assert set(summary["missing"]) == peer_keys
    assert all("--quick" in why for why in summary["missing"].values())
    for target in TARGETS:
        if target.key not in peer_keys:
            value = summary[target.key]
            assert isinstance(value, float) and math.isfinite(value), target.key
    assert summary["quick"] is True
    assert {"torch", "transformers"} <= set(summary["versions"])
    assert summary["machine"]["cpu_count"] >= 1


def test_every_benchmark_wrote_its_result_and_report_section(quick_suite):
    report = (quick_suite.out_dir / "report.md").read_text()
    assert report.startswith("# Benchmark report") and "`python -m bench --quick`" in report
    assert "report() failed" not in report
    for bench in BENCHMARKS:
        result = load_result(quick_suite, bench.name)
        assert result["quick"] is True, bench.name
        assert "machine" in result, bench.name
    for target in TARGETS:
        assert f"`{target.key}`" in report
    plots = list(quick_suite.out_dir.glob("*.png"))
    assert plots, "no plots written"
    for png in plots:
        assert png.read_bytes()[:8] == PNG_MAGIC, png.name
        assert f"]({png.name})" in report, png.name
