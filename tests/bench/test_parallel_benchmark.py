"""The tensor- and pipeline-parallel benchmark in the quick suite: TP=2's and PP=2's float32 greedy
tokens checked against TP=1 before timing, their figures agree with their rotations' runs, rank 0's
collectives (TP=2) and stage 0's p2p messages (PP=2) were timed."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from bench.parallel import KEY, PP, PP_KEY, TP
from tests.bench.checks import check_report, quick_result

pytestmark = pytest.mark.bench

SYSTEMS = {"tp1", "tp1_all_cores", "tp2", "pp2"}
KEYS = {KEY, PP_KEY}
ROTATIONS = {"tp2": ["tp1", "tp1_all_cores", "tp2"], "pp2": ["tp1", "pp2"]}


def test_parallel(quick_suite):
    result = quick_result(quick_suite, "parallel", KEYS, plots=1)
    assert result["tensor_parallel"]["measured"] is True
    assert (
        result["tensor_parallel"]["size"] == TP and result["tensor_parallel"]["backend"] == "gloo"
    )
    fidelity = result["fidelity"]
    assert fidelity["reference"] == "tp1" and set(fidelity["agreement"]) == SYSTEMS - {"tp1"}
    # float32: a tie may part a path late (reported), but the tokens agree nearly throughout.
    assert all(0.9 <= a["tokens"] <= 1 for a in fidelity["agreement"].values())
    assert fidelity["identical"] == all(a["requests"] == 1 for a in fidelity["agreement"].values())
    # One multi-rank engine per process: each is timed in its own rotation with TP=1, and its
    # ratio is against that rotation's TP=1 runs.
    rotations = result["rotations"]
    assert {name: r["systems"] for name, r in rotations.items()} == ROTATIONS
    repeats = result["repeats"]
    for r in rotations.values():
        assert all(len(s) == repeats and min(s) > 0 for s in r["seconds"].values())
    seconds = result["seconds"]
    assert set(seconds) == SYSTEMS
    assert seconds["tp1"] == rotations["tp2"]["seconds"]["tp1"] + rotations["pp2"]["seconds"]["tp1"]
    assert all(len(s) == repeats for name, s in seconds.items() if name != "tp1")
    tokens = result["workload"]["output_tokens"]
    for name, s in seconds.items():
        rate = tokens / statistics.median(s)
        assert result["output_tokens_per_second"][name] == pytest.approx(rate)
    for name, key in (("tp2", KEY), ("pp2", PP_KEY)):
        own = rotations[name]["seconds"]
        ratio = statistics.median(own["tp1"]) / statistics.median(own[name])
        assert result["summary"][key] == pytest.approx(ratio)
        assert result["ratio_vs_tp1"][name] == pytest.approx(ratio)
        assert rotations[name]["ratio_vs_tp1"][name] == pytest.approx(ratio)
    assert result["pipeline_parallel"]["measured"] is True
    assert result["pipeline_parallel"]["size"] == PP
    assert result["pipeline_parallel"]["tensor_parallel_size"] == 1
    assert result["settings"]["engine_pp2"]["pipeline_parallel_size"] == PP
    assert result["settings"]["engine"]["tensor_parallel_size"] == TP
    threads = result["settings"]["torch_threads"]
    assert (
        threads["tp1"] == threads["tp2"] == threads["pp2"] == result["settings"]["worker_threads"]
    )
    assert threads["tp1_all_cores"] == TP * threads["tp1"]


def test_collectives_were_timed(quick_suite):
    result = quick_result(quick_suite, "parallel", KEYS, plots=1)
    c = result["collectives"]
    layers = result["model"]["layers"]
    # Each step: two all-reduces per layer and the embedding's one, one all-gather of the
    # logits (steps that sample), one broadcast.
    assert c["steps"] > 0 and c["calls"]["step_broadcast"] == c["steps"]
    assert c["calls"]["all_reduce"] == (2 * layers + 1) * c["steps"]
    assert 0 < c["calls"]["all_gather"] <= c["steps"]
    assert c["all_reduce_per_step"] == pytest.approx(2 * layers + 1)
    total = sum(c["seconds"].values())
    assert 0 < c["collective_share"] == pytest.approx(total / c["wall_seconds"])
    assert c["collective_share"] < 1
    assert c["share_of_wall"]["all_reduce"] == pytest.approx(
        c["seconds"]["all_reduce"] / c["wall_seconds"]
    )
    b = c["broadcast"]
    assert 0 < b["bytes_per_step"]["mean"] <= b["bytes_per_step"]["max"]
    assert b["bytes_total"] == pytest.approx(b["bytes_per_step"]["mean"] * c["steps"])
    assert b["seconds_per_step"] > 0


def test_p2p_was_timed(quick_suite):
    result = quick_result(quick_suite, "parallel", KEYS, plots=1)
    p = result["p2p"]
    # Each step: stage 0 sends its activations forward once and receives the scored rows once,
    # after one broadcast; no all-reduce is timed (TP=1 within the stage).
    assert p["steps"] > 0 and p["calls"]["step_broadcast"] == p["steps"]
    assert p["calls"]["send_forward"] == p["calls"]["recv_output"] == p["steps"]
    assert "all_reduce" not in p["calls"]
    share = (p["seconds"]["send_forward"] + p["seconds"]["recv_output"]) / p["wall_seconds"]
    assert 0 < p["p2p_share"] == pytest.approx(share) and p["p2p_share"] < 1
    assert p["collective_share"] == pytest.approx(sum(p["seconds"].values()) / p["wall_seconds"])
    f = p["send_forward"]
    # hidden + residual, float32, of every token of every step: [2, T, hidden].
    hidden = result["model"]["hidden"]
    assert f["bytes_per_step"] > 0 and f["bytes_total"] % (2 * hidden * 4) == 0
    assert f["bytes_total"] == pytest.approx(f["bytes_per_step"] * p["steps"])
    assert p["recv_output_seconds_per_step"] > 0


def test_report_and_summary(quick_suite):
    result = quick_result(quick_suite, "parallel", KEYS, plots=1)
    lines = check_report("parallel", result)
    assert any("PP=2" in line and "TP=1" in line for line in lines)
    assert any("no micro-batch overlap" in line for line in lines)
    assert any("no target" in line for line in lines)
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    for key in KEYS:
        assert math.isfinite(summary[key]) and summary["sources"][key] == "parallel"
        assert key not in summary["targets"]
