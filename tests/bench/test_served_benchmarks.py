"""The benchmarks through a real tritonserver (serving, encoders_served) in the quick suite: their
output checks passed, and their figures agree with the requests they sent."""

from __future__ import annotations

import pytest

from tests.bench.checks import quick_result

pytestmark = [pytest.mark.bench, pytest.mark.e2e]


def test_serving(quick_suite):
    result = quick_result(quick_suite, "serving", {"served_vs_direct"}, 2, against_target=True)
    fidelity = result["fidelity"]
    assert fidelity["identical"] == fidelity["prompts"] > 0
    concurrencies = result["workload"]["concurrencies"]
    runs = result["runs"]
    # Every (system, concurrency) ran each repeat, plus one Poisson run per repeat.
    assert len(runs) == result["repeats"] * (2 * len(concurrencies) + 1)
    assert {(r["system"], r["concurrency"]) for r in runs if r["load"] == "closed"} == {
        (s, c) for s in ("served", "direct") for c in concurrencies
    }
    for run in runs:
        per_request = run["per_request"]
        assert all(
            0 < t <= e for t, e in zip(per_request["ttft_s"], per_request["e2e_s"], strict=True)
        )
        metrics = run["metrics"]
        assert metrics["output_tokens_per_s"] > 0 and metrics["ttft_p50_s"] <= metrics["ttft_p99_s"]
        # Closed-loop throughput is total output tokens over the run's wall time.
        requests = result["workload"]["requests_per_run"].get(
            str(run["concurrency"]), result["workload"]["poisson_requests"]
        )
        tokens = requests * result["workload"]["max_tokens"]
        assert metrics["output_tokens_per_s"] == pytest.approx(tokens / metrics["seconds"])


def test_encoders_served(quick_suite):
    result = quick_result(
        quick_suite,
        "encoders_served",
        {"embedding_served_vs_sentence_transformers", "rerank_served_vs_cross_encoder"},
        0,
        against_target=True,
    )
    gates = result["fidelity_gates"]
    embedding, rerank = result["embedding"], result["rerank"]
    assert embedding["fidelity"]["passed"] and rerank["fidelity"]["passed"]
    assert min(embedding["fidelity"]["timed_passes"]) >= gates["embedding_min_cosine"]
    assert max(rerank["fidelity"]["timed_passes"]) <= gates["rerank_max_relative_error"]
    for model in (embedding, rerank):
        assert model["items"] > 0 and model["tokens"] > model["items"]
        assert 0 < model["served_latency_s"]["p50"] <= model["served_latency_s"]["p99"]
        assert model["server_batching"]["micro_batches"] >= 1
