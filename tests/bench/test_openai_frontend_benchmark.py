"""The OpenAI frontend benchmark in the quick suite: every request's text through the frontend
equalled its gRPC text, both systems ran interleaved, and its figures agree with its runs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tests.bench.checks import quick_result

pytestmark = [pytest.mark.bench, pytest.mark.e2e]


def test_openai_frontend(quick_suite):
    result = quick_result(
        quick_suite, "openai_frontend", {"openai_vs_grpc"}, 1, against_target=True
    )
    fidelity, workload = result["fidelity"], result["workload"]
    assert fidelity["identical"] == fidelity["requests"] == workload["requests_per_run"] > 0
    assert 0 <= result["timed_same_text"] <= 1
    runs = result["runs"]
    assert len(runs) == 2 * result["repeats"]
    # Interleaved: each repeat runs both systems, the first one alternating.
    firsts = [runs[2 * k]["system"] for k in range(result["repeats"])]
    assert firsts == [("frontend", "grpc")[k % 2] for k in range(result["repeats"])]
    rates = {"frontend": [], "grpc": []}
    for run in runs:
        per_request = run["per_request"]
        assert len(per_request["ttft_s"]) == workload["requests_per_run"]
        assert all(
            0 < t <= e for t, e in zip(per_request["ttft_s"], per_request["e2e_s"], strict=True)
        )
        metrics = run["metrics"]
        tokens = workload["requests_per_run"] * workload["max_tokens"]
        assert metrics["output_tokens_per_s"] == pytest.approx(tokens / metrics["seconds"])
        rates[run["system"]].append(metrics["output_tokens_per_s"])
    ratio = statistics.median(rates["frontend"]) / statistics.median(rates["grpc"])
    assert result["summary"]["openai_vs_grpc"] == pytest.approx(ratio)
    added = result["ttft_added_s"]
    latency = result["latency"]
    assert added["p50"] == pytest.approx(
        latency["frontend"]["ttft_p50_s"] - latency["grpc"]["ttft_p50_s"]
    )
    assert all(math.isfinite(v) for v in added.values())


def test_openai_frontend_in_summary(quick_suite):
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    value = summary["openai_vs_grpc"]
    assert isinstance(value, float) and math.isfinite(value)
    assert summary["sources"]["openai_vs_grpc"] == "openai_frontend"
