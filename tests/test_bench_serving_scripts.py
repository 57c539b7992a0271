"""The serving and encoder benchmark scripts run end to end in --quick mode: each writes a valid
result whose fidelity checks passed and whose summary figures are finite, and its report() and
plot() work on that result."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = REPO_ROOT / "scripts"


def run_quick(name: str, tmp_path: Path) -> tuple[dict, object]:
    """Run scripts/bench_<name>.py --quick --threads 1; (its JSON result, its module)."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS_DIR / f"bench_{name}.py"),
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
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Strict parsing: NaN / Infinity are not JSON.
    result = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert result["benchmark"] == name and result["quick"] is True
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert "cpu_count" in result["machine"]
    if str(SCRIPTS_DIR) not in sys.path:
        sys.path.insert(0, str(SCRIPTS_DIR))
    return result, importlib.import_module(f"bench_{name}")


def check_summary(result: dict, keys: set[str]) -> None:
    assert set(result["summary"]) == keys
    for value in result["summary"].values():
        assert isinstance(value, float) and math.isfinite(value) and value > 0


def check_report_and_plot(module, result: dict, tmp_path: Path, plots: int) -> None:
    lines = module.report(result)
    assert lines[0].startswith("### ") and any(line.startswith("|---") for line in lines)
    assert any(line.startswith("Target") or "target" in line for line in lines)
    paths = module.plot(result, tmp_path / "plots")
    assert len(paths) == plots
    for path in paths:
        assert path.name.startswith(f"{result['benchmark']}_") and path.suffix == ".png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e
def test_serving_quick(tmp_path):
    result, module = run_quick("serving", tmp_path)
    check_summary(result, {"served_vs_direct"})
    fidelity = result["fidelity"]
    assert fidelity["passed"] and fidelity["identical"] == fidelity["prompts"] > 0
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
    check_report_and_plot(module, result, tmp_path, plots=2)


def test_rerank_quick(tmp_path):
    result, module = run_quick("rerank", tmp_path)
    check_summary(result, {"rerank_vs_cross_encoder"})
    fidelity = result["fidelity"]
    assert fidelity["passed"] and fidelity["max_relative_score_error"] <= fidelity["tolerance"]
    assert fidelity["logit_span"] > 0.1  # the seeded head separates the pairs
    items = result["workload"]["pairs"]
    for name, seconds in result["seconds"].items():
        assert result["items_per_second"][name]["median"] == pytest.approx(items / seconds[0])
    check_report_and_plot(module, result, tmp_path, plots=0)


def test_embedding_quick(tmp_path):
    result, module = run_quick("embedding", tmp_path)
    check_summary(result, {"embedding_vs_sentence_transformers"})
    assert result["fidelity"]["passed"]
    assert result["fidelity"]["min_cosine"] >= result["fidelity"]["gate"]
    tokens = result["tokens"]["total"]
    for name, seconds in result["seconds"].items():
        assert result["tokens_per_second"][name]["median"] == pytest.approx(tokens / seconds[0])
    check_report_and_plot(module, result, tmp_path, plots=0)


@pytest.mark.e2e
def test_encoders_served_quick(tmp_path):
    result, module = run_quick("encoders_served", tmp_path)
    check_summary(
        result, {"embedding_served_vs_sentence_transformers", "rerank_served_vs_cross_encoder"}
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
    check_report_and_plot(module, result, tmp_path, plots=0)
