"""The speculative-decoding benchmark in the quick suite: greedy tokens identical with and without
speculation (n-gram and draft model), its ratios agree with its runs, and the acceptance figures
with its counts."""

from __future__ import annotations

import statistics

import pytest

from bench.spec_decode import KEYS, PEER_KEY, SYSTEMS, WORKLOAD_SYSTEMS
from tests.bench.checks import quick_result

pytestmark = pytest.mark.bench


def test_spec_decode(quick_suite):
    result = quick_result(quick_suite, "spec_decode", set(KEYS), plots=0, against_target=True)
    assert set(result["fidelity"]) == {"c1", "c16"}
    repeats = result["repeats"]
    for workload, seconds in result["seconds"].items():
        assert set(seconds) == set(WORKLOAD_SYSTEMS[workload])
        assert all(len(s) == repeats and min(s) > 0 for s in seconds.values())
        for name in seconds.keys() - {"plain"}:
            ratio = statistics.median(seconds["plain"]) / statistics.median(seconds[name])
            assert result["summary"][f"spec_{name}_vs_plain_{workload}"] == pytest.approx(ratio)
    assert set(result["speculation"]) == set(SYSTEMS) - {"plain"}
    for spec in result["speculation"].values():
        assert spec["drafts"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
        rate = spec["accepted_tokens"] / spec["draft_tokens"]
        assert spec["acceptance_rate"] == pytest.approx(rate)
        assert spec["mean_accepted_length"] == pytest.approx(
            1 + spec["accepted_tokens"] / spec["drafts"]
        )
    # Quick mode runs no peer: its figure is missing, saying why.
    assert set(result["missing"]) == {PEER_KEY} and "--quick" in result["missing"][PEER_KEY]
    assert result["peer"]["run"] is False
