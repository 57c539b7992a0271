"""Assertions every benchmark's quick result must pass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.skeleton import load

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SuiteRun:
    """What one `python -m bench --quick` run left: its output dir, exit code and log."""

    out_dir: Path
    returncode: int
    stderr: str


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def quick_result(
    suite: SuiteRun,
    name: str,
    summary_keys: set[str],
    plots: int,
    benchmark: str = "",
    against_target: bool = False,
) -> dict:
    """The benchmark's result, after the checks every benchmark passes; `against_target`: its
    headline figures are positive and its report compares them with their target."""
    result = load_result(suite, name)
    check_common(result, benchmark or name, summary_keys)
    lines = check_report(name, result)
    check_plots(suite, name, plots)
    if against_target:
        assert all(value > 0 for value in result["summary"].values())
        assert any(line.startswith("Target") or "target" in line for line in lines)
    return result


def load_result(suite: SuiteRun, name: str) -> dict:
    """The benchmark's JSON result, parsed strictly (NaN / Infinity are not JSON); a missing
    result fails with the benchmark's log."""
    path = suite.out_dir / f"{name}.json"
    if not path.exists():
        log = suite.out_dir / f"{name}.log"
        pytest.fail(f"{name} wrote no result:\n{log.read_text()[-4000:] if log.exists() else ''}")
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def check_common(result: dict, benchmark: str, summary_keys: set[str]) -> None:
    """Mode, device and machine recorded; finite headline figures; every output check passed."""
    assert result["benchmark"] == benchmark and result["quick"] is True
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert "cpu_count" in result["machine"]
    assert set(result["summary"]) == summary_keys
    for value in result["summary"].values():
        assert isinstance(value, float) and math.isfinite(value)
    # One record per comparison (a dict each), or a single record.
    fidelity = result.get("fidelity", {})
    checks = [c for c in fidelity.values() if isinstance(c, dict)] or [fidelity]
    assert all(c.get("passed", True) is True for c in checks)


def check_report(name: str, result: dict) -> list[str]:
    """The benchmark's report section: a heading and a table."""
    lines = load(name).section(result)
    assert lines[0].startswith("### ") and any(line.startswith("|---") for line in lines)
    return lines


def check_plots(suite: SuiteRun, name: str, count: int) -> None:
    """The suite wrote `count` PNGs named after the benchmark, each linked from the report."""
    report = (suite.out_dir / "report.md").read_text()
    paths = sorted(suite.out_dir.glob(f"{name}_*.png"))
    assert len(paths) == count, paths
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC, path.name
        assert f"]({path.name})" in report, path.name


PEER_KEYS = {
    "engine_peers": {
        "engine_vs_openvino_genai",
        "engine_bf16_vs_openvino_genai_bf16",
        "engine_vs_ctranslate2",
        "engine_kv_int8_vs_openvino_genai",
    },
    "embedding_peers": {"embedding_vs_openvino", "embedding_bf16_vs_openvino_bf16"},
}
"""The summary keys each peer benchmark gives (missing, with a reason, in --quick mode)."""

OTHER_PEER_KEYS = {
    "quantized_engine": {"engine_w4a16_vs_openvino_genai_int4"},
    "spec_decode": {"spec_ngram_vs_openvino_genai_prompt_lookup_c1"},
    "gguf_perplexity": {f"gguf_perplexity_vs_llama_cpp_{t}" for t in ("q8_0", "q4_k", "q4_0")},
    "real_sizes": {
        *(f"c1_bandwidth_fraction_{p}" for p in ("bf16", "int4")),
        *(f"c1_decode_vs_openvino_genai_{p}" for p in ("f32", "bf16", "int4")),
        *(f"c1_decode_vs_llama_cpp_{p}" for p in ("f32", "bf16", "q4_0")),
        *(f"c16_throughput_vs_openvino_genai_{p}" for p in ("bf16", "int4")),
        "small_model_c1_vs_openvino_genai",
    },
}
"""Figures missing in --quick mode of benchmarks that give figures of their own too: the peer
figures, and real_sizes' other precisions (its quick run is float32 only)."""
