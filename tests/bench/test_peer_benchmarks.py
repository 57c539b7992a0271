"""The peer benchmarks (engine_peers, embedding_peers). In the quick suite the peers' environment is
not built: each reports our system alone, the peers skipped with the reason, and no peer figure in
summary.json. Then the rules their figures follow, on made-up runs (nothing timed)."""

from __future__ import annotations

import json
import sys

import pytest

from bench.peers import env, plan
from tests.bench.checks import PEER_KEYS, check_report, load_result

pytestmark = pytest.mark.bench

OURS = {"engine_peers": "engine", "embedding_peers": "embedder"}


@pytest.mark.parametrize("name", sorted(PEER_KEYS))
def test_quick_mode_skips_the_peers_and_says_why(quick_suite, name):
    result = load_result(quick_suite, name)
    assert result["benchmark"] == name and result["quick"] is True
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    peers = result["peers"]
    assert peers["run"] is False and "--quick" in peers["reason"] and not peers["models"]
    # Our system still ran alone, at one thread, in float32.
    [run] = result["runs"]
    assert (run["threads"], run["dtype"], run["torch_threads"]) == (1, "float32", 1)
    assert set(run["seconds"]) == {OURS[name]} and run["ratio_vs_ours"] == {}
    assert all(s > 0 for s in run["seconds"][OURS[name]])
    # No peer figure, each missing key with the reason, in the result and its report.
    assert result["summary"] == {}
    assert set(result["missing"]) == PEER_KEYS[name]
    assert all("--quick" in why for why in result["missing"].values())
    lines = check_report(name, result)
    assert any("not measured" in line and "--quick" in line for line in lines)
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    assert not PEER_KEYS[name] & set(summary) and name not in summary["failed"]


def _run(threads, dtype, ratios, excluded=None):
    return {"threads": threads, "dtype": dtype, "ratio_vs_ours": ratios, "excluded": excluded or {}}


KEYS = {("peer", "float32"): "vs_peer", ("peer", "bfloat16"): "bf16_vs_peer"}


def test_a_summary_figure_is_the_worst_thread_count():
    runs = [_run(1, "float32", {"peer": 1.3}), _run(2, "float32", {"peer": 0.8})]
    summary, missing = plan.summarize(runs, KEYS, {"bfloat16": "no native bf16"}, None)
    assert summary == {"vs_peer": 0.8}
    assert missing == {"bf16_vs_peer": "no native bf16"}


def test_a_figure_missing_at_one_thread_count_is_missing_with_why():
    runs = [_run(1, "float32", {"peer": 1.3}), _run(2, "float32", {}, {"peer": "tokens differ"})]
    summary, missing = plan.summarize(runs, KEYS, {}, "peers not run")
    assert summary == {}
    assert missing == {"vs_peer": "2 thread(s): tokens differ", "bf16_vs_peer": "peers not run"}
    lines = plan.missing_lines({"missing": {"a": "why", "b": "why"}})
    assert lines == ["- `a`, `b` not measured: why"]


def test_bf16_runs_only_where_native_unless_asked(monkeypatch):
    monkeypatch.setattr(plan, "native_bf16", lambda: False)
    dtypes, skipped = plan.precisions("auto")
    assert dtypes == ["float32"] and "bf16" in skipped["bfloat16"]
    monkeypatch.setattr(plan, "native_bf16", lambda: True)
    assert plan.precisions("auto") == (["float32", "bfloat16"], {})
    assert plan.precisions("bfloat16") == (
        ["bfloat16"],
        {"float32": "float32 not run: --dtype bfloat16"},
    )


def test_a_failed_build_step_is_named():
    with pytest.raises(env.PeersUnavailable, match="at step 'pip install' .*exit 3.*boom"):
        env.run_step(
            "pip install", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], 60
        )


def test_the_peers_run_only_in_full_cpu_runs():
    import argparse

    import torch

    quick = argparse.Namespace(quick=True, peers=False)
    assert "--quick" in plan.why_no_peers(quick, torch.device("cpu"))
    assert (
        plan.why_no_peers(argparse.Namespace(quick=True, peers=True), torch.device("cpu")) is None
    )
    full = argparse.Namespace(quick=False, peers=True)
    assert "CPU" in plan.why_no_peers(full, torch.device("cuda"))


def test_an_output_parting_from_ours_off_a_tie_is_flagged(tmp_path):
    import torch

    from bench.engine_peers import parting_points
    from bench.llm import Workload, load_hf_model
    from tooling.checkpoints import QUICK, build_random_llama
    from tooling.hf_reference import hf_greedy

    build_random_llama(QUICK, tmp_path, seed=0)
    model = load_hf_model(tmp_path, torch.device("cpu"), "float32")
    workload = Workload([[5, 6, 7, 8], [9, 10, 11]], [6, 6])
    ours = [hf_greedy(model, p, 6) for p in workload.prompts]
    theirs = [ours[0], [*ours[1][:3], (ours[1][3] + 1) % QUICK.vocab, *ours[1][4:]]]
    [parting] = parting_points(tmp_path, workload, ours, theirs)
    assert (parting["request"], parting["at"], parting["tie"]) == (1, 3, False)
    assert parting["gap"] > 0
