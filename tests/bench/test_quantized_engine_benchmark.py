"""The W4A16-checkpoint benchmark in the quick suite: the W4A16 engine's float32 greedy tokens
matched compressed-tensors' own decompression before timing, its 4-bit layers loaded, the weight
bytes add up, the peer was skipped with why, and its figures agree with its runs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from bench.quantized_engine import BASELINE, GROUP_SIZE, KEY_BF16, KEY_BYTES, KEY_PEER, OURS
from tests.bench.checks import check_report, quick_result

pytestmark = pytest.mark.bench


def test_quantized_engine(quick_suite):
    result = quick_result(
        quick_suite, "quantized_engine", {KEY_BF16, KEY_BYTES}, plots=1, against_target=True
    )
    check = result["fidelity"]["w4a16_vs_compressed_tensors"]
    assert check["passed"] and check["agreement"] == {"requests": 1.0, "tokens": 1.0}
    # Every projection (fused qkv, o, gate_up, down per layer) runs a 4-bit WNA16 layer.
    assert result["wna16_layers"] == 4 * result["model"]["layers"]
    assert sum(result["wna16_backends"].values()) == result["wna16_layers"]
    assert set(result["wna16_backends"]) <= {"cpu", "torch"}
    assert result["bits"] == [4] and result["group_sizes"] == [GROUP_SIZE]
    [run] = result["runs"]
    assert (run["threads"], run["dtype"], run["torch_threads"]) == (1, "float32", 1)
    assert set(run["seconds"]) == {OURS, BASELINE}
    assert all(len(s) == result["repeats"] and min(s) > 0 for s in run["seconds"].values())
    ratio = statistics.median(run["seconds"][BASELINE]) / statistics.median(run["seconds"][OURS])
    assert run["ratio_vs_ours"] == {BASELINE: pytest.approx(ratio)}
    assert result["summary"][KEY_BF16] == pytest.approx(ratio)
    assert 0 <= run["agreement_with_w4a16"][BASELINE]["tokens"] <= 1
    engine_workload = run["engine_workload"]
    assert set(engine_workload["seconds"]) == {OURS, BASELINE}
    assert engine_workload["w4a16_vs_bf16"] > 0
    for name, split in run["time_split"].items():
        assert split["wall"] == pytest.approx(statistics.median(run["seconds"][name]))
        assert split["gemm"] > 0


def test_weight_bytes_add_up(quick_suite):
    result = quick_result(quick_suite, "quantized_engine", {KEY_BF16, KEY_BYTES}, plots=1)
    b, model = result["weight_bytes"], result["model"]
    assert b["parameters"] == model["parameters"] and b["bf16_model"] == 2 * b["parameters"]
    # 4-bit words (half a byte a weight) and per 128 weights a float32 scale and zero point, or
    # the C++ op's compact form of symmetric groups (a float16 scale, no zero point stored).
    per_weight = b["quantized_layers"] / b["quantized_parameters"]
    assert 0.5 + 2 / GROUP_SIZE <= per_weight <= 0.5 + 8 / GROUP_SIZE
    assert b["w4a16_model"] == b["quantized_layers"] + b["full_precision_rest_bf16"]
    assert b["projections_ratio"] == pytest.approx(per_weight / 2)
    assert b["whole_model_ratio"] == pytest.approx(b["w4a16_model"] / b["bf16_model"])
    assert b["projections_ratio"] < b["whole_model_ratio"] < 1
    assert result["summary"][KEY_BYTES] == b["projections_ratio"]


def test_quick_mode_skips_the_peer_and_says_why(quick_suite):
    result = quick_result(quick_suite, "quantized_engine", {KEY_BF16, KEY_BYTES}, plots=1)
    peers = result["peers"]
    assert peers["run"] is False and "--quick" in peers["reason"] and not peers["models"]
    assert set(result["missing"]) == {KEY_PEER} and "--quick" in result["missing"][KEY_PEER]
    lines = check_report("quantized_engine", result)
    assert any("not measured" in line and "--quick" in line for line in lines)
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    assert math.isfinite(summary[KEY_BF16]) and summary["sources"][KEY_BF16] == "quantized_engine"
    assert summary["targets"][KEY_BF16] == 1.3 and summary["targets"][KEY_PEER] == 1.0
    assert KEY_PEER not in summary and KEY_PEER in summary["missing"]
