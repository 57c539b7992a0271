"""The LLM-engine benchmark scripts run in --quick mode, pass their own fidelity checks, and their
figures agree with what the workload implies; report() and plot() work on their results."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"
SUMMARY_KEYS = {
    "batching_spread": {"continuous_vs_static_at_max_spread"},
    "prefix_cache": {"prefix_cache_ttft_reduction"},
    "kv_memory": {"kv_slot_utilization", "concurrency_gain_vs_preallocation"},
    "preemption": {"swap_vs_recompute_throughput"},
}


def load_script(name: str):
    """The script as a module (the way bench_suite imports it: scripts/ on sys.path)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(f"bench_{name}")


def run_quick(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / f"bench_{name}.py"),
            "--quick",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def check_common(name: str, result: dict, tmp_path: Path) -> None:
    assert result["benchmark"] == name and result["quick"] is True
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert set(result["summary"]) == SUMMARY_KEYS[name]
    for value in result["summary"].values():
        assert isinstance(value, float) and math.isfinite(value)
    # One record per comparison (a dict each), or a single record.
    checks = [c for c in result["fidelity"].values() if isinstance(c, dict)] or [result["fidelity"]]
    assert checks and all(c["passed"] is True for c in checks)
    assert "cpu_count" in result["machine"]
    module = load_script(name)
    lines = module.report(result)
    assert lines[0].startswith("### ") and any(line.startswith("|") for line in lines)
    paths = module.plot(result, tmp_path)
    assert paths and all(p.name.startswith(f"{name}_") and p.stat().st_size > 0 for p in paths)


def test_batching_spread(tmp_path):
    result = run_quick("batching_spread", tmp_path)
    check_common("batching_spread", result, tmp_path)
    w = result["workload"]
    for run in result["runs"]:
        lens, s = run["output_lens"], run["spread"]
        assert len(lens) == w["requests"] and run["useful_tokens"] == sum(lens)
        assert all(
            round(w["mean_output"] * (1 - s)) <= n <= round(w["mean_output"] * (1 + s))
            for n in lens
        )
        batches = [lens[i : i + w["batch_size"]] for i in range(0, len(lens), w["batch_size"])]
        slots = sum(len(b) * max(b) for b in batches)
        assert run["static_useful_share"] == pytest.approx(sum(lens) / slots)
        assert set(run["tokens_per_second"]) == {"continuous", "static_engine", "hf_static"}
        # Each static batch is one prefill step plus decodes up to its longest output; the
        # continuous engine never needs more steps.
        assert run["engine_steps"]["static_engine"] == sum(max(b) for b in batches)
        assert run["engine_steps"]["continuous"] <= run["engine_steps"]["static_engine"]
        assert all(len(v) == result["repeats"] for v in run["seconds"].values())
    assert result["runs"][0]["static_useful_share"] == 1.0  # spread 0: equal lengths
    assert result["runs"][-1]["static_useful_share"] < 1.0
    assert all(f["exact_required"] for f in result["fidelity"].values())


def test_prefix_cache(tmp_path):
    result = run_quick("prefix_cache", tmp_path)
    check_common("prefix_cache", result, tmp_path)
    w = result["workload"]
    # Hits are whole blocks of the shared prefix (16-token blocks), over every prompt token.
    expected = (w["prefix_len"] // 16 * 16) / (w["prefix_len"] + w["suffix_len"])
    assert result["hit_rate"]["cache_on"] == [pytest.approx(expected)] * result["repeats"]
    assert result["hit_rate"]["cache_off"] == [0.0] * result["repeats"]
    for mode in ("cache_on", "cache_off"):
        assert len(result["ttft_seconds"][mode]) == w["requests"] * result["repeats"]
        assert 0 < result["ttft_ms"][mode]["p50"] <= result["ttft_ms"][mode]["p99"]


def test_kv_memory(tmp_path):
    result = run_quick("kv_memory", tmp_path)
    check_common("kv_memory", result, tmp_path)
    module = load_script("kv_memory")
    settings, peak = result["settings"], result["utilization"]["peak"]
    assert 0 < peak["tokens"] <= peak["slots"] <= settings["pool_tokens"]
    assert result["summary"]["kv_slot_utilization"] == pytest.approx(peak["tokens"] / peak["slots"])
    # Independent block arithmetic over the same lengths: leading sequences whose blocks fit.
    lengths = module.sequence_lengths(module.PRESETS["quick"], result["workload"]["seed"])
    blocks = [math.ceil(n / settings["block_size"]) for n in lengths]
    fit = max(k for k in range(len(blocks) + 1) if sum(blocks[:k]) <= settings["num_blocks"])
    assert fit < len(lengths), "the quick workload must overflow the pool"
    for max_len, c in result["concurrency"].items():
        assert c["paged"] == fit
        assert c["contiguous"] == settings["pool_tokens"] // int(max_len)
    series = result["utilization"]["series"]
    assert max(s["slots"] for s in series) == peak["slots"]


def test_preemption(tmp_path):
    result = run_quick("preemption", tmp_path)
    check_common("preemption", result, tmp_path)
    assert set(result["preemptions"]["baseline"]) == {0}
    assert min(result["preemptions"]["recompute"]) > 0 and min(result["preemptions"]["swap"]) > 0
    engines = result["settings"]["engines"]
    assert engines["recompute"]["num_blocks"] < engines["baseline"]["num_blocks"]
    rates = result["output_tokens_per_second"]
    assert all(0 < r["min"] <= r["median"] <= r["max"] for r in rates.values())
