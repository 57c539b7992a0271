"""make gpu-check: without a GPU it says so, writes its summary with every step skipped and exits
0; its steps run within one budget, each failure or overrun recorded (checked here with stand-in
commands, since the real steps need a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tooling import gpu_check
from tooling.repository import REPO_ROOT


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tooling.gpu_check", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["gpu"] is False and summary["device"] is None
    names = [step["name"] for step in summary["steps"]]
    assert names == ["kernels", "engine", "cuda_graph_decode", "bench"]
    assert {step["status"] for step in summary["steps"]} == {"skipped"}


def test_steps_run_in_one_budget_and_record_how_each_ended():
    python = sys.executable
    plan = [
        gpu_check.Step("passes", [python, "-c", "print('fine')"]),
        gpu_check.Step("fails", [python, "-c", "raise SystemExit(3)"]),
        gpu_check.Step("unbuilt", [], note="not yet"),
        gpu_check.Step("overruns", [python, "-c", "import time; time.sleep(30)"]),
        gpu_check.Step("after", [python, "-c", "pass"]),
    ]
    results = {r.name: r for r in gpu_check.run_steps(plan, budget_seconds=8)}
    assert results["passes"].status == "passed" and "fine" in results["passes"].output_tail
    assert results["fails"].status == "failed" and results["fails"].returncode == 3
    assert results["unbuilt"].status == "not_implemented" and results["unbuilt"].note == "not yet"
    assert results["overruns"].status == "timeout"
    assert results["overruns"].seconds == pytest.approx(8, abs=3)
    assert results["after"].status == "skipped"  # nothing left of the budget


def test_the_real_plan_names_existing_tests_and_benchmarks():
    from bench.__main__ import BENCHMARKS

    plan = {step.name: step for step in gpu_check.steps()}
    for test in gpu_check.ENGINE_TESTS:
        path, name = test.split("::")
        assert f"def {name}(" in (REPO_ROOT / path).read_text(), test
    assert set(gpu_check.BENCHMARKS.split(",")) <= {b.name for b in BENCHMARKS}
    assert plan["engine"].env["LLM_TEST_DEVICE"] == "cuda"
    assert (REPO_ROOT / gpu_check.DECODE_GRAPH_TESTS).is_file()
    assert plan["cuda_graph_decode"].env["LLM_TEST_DEVICE"] == "cuda"
