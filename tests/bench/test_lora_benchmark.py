"""The multi-LoRA benchmark in the quick suite: base requests of the mixed run matched the base
run, adapters changed their outputs, and its figures agree with its runs."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tests.bench.checks import quick_result

pytestmark = pytest.mark.bench


def test_lora(quick_suite):
    result = quick_result(
        quick_suite,
        "lora",
        {"lora_mixed_vs_base", "lora_adapter_load_ms"},
        plots=1,
        against_target=True,
    )
    assert result["fidelity"]["adapter_outputs_changed"] >= 0.5
    seconds, repeats = result["seconds"], result["repeats"]
    assert all(len(s) == repeats and min(s) > 0 for s in seconds.values())
    ratios = [b / m for b, m in zip(seconds["base"], seconds["mixed"], strict=True)]
    assert result["mixed_vs_base_per_repeat"] == pytest.approx(ratios)
    assert result["summary"]["lora_mixed_vs_base"] == pytest.approx(statistics.median(ratios))
    loads = result["load_ms_raw"]
    assert len(loads["disk_ms"]) == len(loads["slot_ms"]) == result["adapters"]["count"]
    assert all(v > 0 for values in loads.values() for v in values)


def test_lora_in_summary(quick_suite):
    summary = json.loads((quick_suite.out_dir / "summary.json").read_text())
    assert math.isfinite(summary["lora_mixed_vs_base"])
    assert summary["sources"]["lora_mixed_vs_base"] == "lora"
    assert summary["targets"]["lora_mixed_vs_base"] == 0.7
