"""The structured-outputs benchmark in the quick suite: its constrained outputs validated, the
free run matched the structured run token for token, and its figures (free requests' latency
beside costly compiles included) agree with its runs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tests.bench.checks import quick_result

pytestmark = pytest.mark.bench


def test_structured_outputs(quick_suite):
    result = quick_result(
        quick_suite, "structured_outputs", {"structured_vs_free"}, plots=1, against_target=True
    )
    workload, repeats = result["workload"], result["repeats"]
    tokens = workload["output_tokens"]
    assert tokens["structured"] == tokens["free"] < tokens["free_full"]
    assert tokens["free_full"] == workload["requests"] * workload["max_tokens"]
    check = result["fidelity"]["constrained_outputs"]
    assert check["constrained"] == workload["constrained"] == workload["requests"] // 2
    assert 2 * check["stopped_and_valid"] >= check["constrained"]
    assert result["fidelity"]["free_rows_untouched"]["exact_required"]
    rates = {}
    for name, seconds in result["seconds"].items():
        assert len(seconds) == repeats and all(s > 0 for s in seconds)
        rates[name] = [tokens[name] / s for s in seconds]
        median = statistics.median(rates[name])
        assert result["output_tokens_per_second"][name]["median"] == pytest.approx(median)
    # Same tokens in both runs: the ratio of rates is the inverse ratio of times, per repeat.
    seconds = result["seconds"]
    ratios = [f / c for c, f in zip(seconds["structured"], seconds["free"], strict=True)]
    assert result["structured_vs_free_per_repeat"] == pytest.approx(ratios)
    assert result["summary"]["structured_vs_free"] == pytest.approx(statistics.median(ratios))
    compile_ms = result["compile_ms"]
    assert 0 < compile_ms["cached"]["median"] < compile_ms["cold"]["median"]
    assert all(len(v) == workload["schemas"] for v in result["compile_seconds"].values())
    assert 0 <= result["bitmask_fill_share"] < 1
    # Free requests beside costly compiles: raw seconds per repeat and their ratio.
    beside = result["compile_interference"]
    alone, during = beside["alone_seconds"], beside["during_compile_seconds"]
    assert len(alone) == len(during) == repeats and all(s > 0 for s in alone + during)
    assert beside["ratio_per_repeat"] == pytest.approx(
        [d / a for d, a in zip(during, alone, strict=True)]
    )
    ratio = result["free_request_latency_during_compile_ratio"]
    assert ratio == pytest.approx(statistics.median(beside["ratio_per_repeat"])) and ratio > 0
    assert (
        beside["costly_requests"] == 3 and len(beside["costly_until_finished_seconds"]) == repeats
    )


def test_structured_outputs_in_summary(quick_suite):
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    value = summary["structured_vs_free"]
    assert isinstance(value, float) and math.isfinite(value)
    assert summary["sources"]["structured_vs_free"] == "structured_outputs"
    assert summary["targets"]["structured_vs_free"] == 0.9
