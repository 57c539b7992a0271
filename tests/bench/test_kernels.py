"""`python -m bench.kernels --tiny` runs end to end (Triton's interpreter on CPU) and records
every kernel as correct. Its own run: the kernels are not part of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.checks import REPO_ROOT

pytestmark = pytest.mark.bench
KERNELS = {
    "paged_attention_decode",
    "paged_attention_long_decode",
    "paged_attention_prefill_chunk",
    "rms_norm_residual",
    "apply_rotary",
    "silu_and_mul",
    "write_kv_cache",
}


def test_tiny_run_writes_correct_results(tmp_path):
    out = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernels", "--tiny", "--dtype", "float16", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "tiny" and report["dtype"] == "float16"
    assert report["peaks"]["copy_gbps"] > 0 and report["peaks"]["matmul_tflops"] > 0
    by_name = {k["name"]: k for k in report["kernels"]}
    assert set(by_name) == KERNELS
    for kernel in by_name.values():
        assert kernel["correct"] and kernel["triton_ms"] > 0 and kernel["torch_ms"] > 0, kernel
        assert kernel["achieved"], kernel
    assert "ok " in result.stdout and "BAD" not in result.stdout
