"""bench.gemv_bandwidth runs and reports what it says, at tiny sizes (its figures mean nothing
here: timed figures never decide a test)."""

from __future__ import annotations

import pytest

from bench import gemv_bandwidth


@pytest.fixture
def library() -> None:
    from kernels import cpu_extension

    if not cpu_extension.load():
        pytest.skip(f"the C++ CPU kernels are not built: {cpu_extension.check_build()}")


def test_measure_reports_each_dtype_shape_and_row_count(library):
    shapes = {"tiny": (96, 256), "wide": (256, 128)}
    dtypes = ["float32", "float32-onednn", "w4a16"]
    result = gemv_bandwidth.measure(1, shapes, dtypes, 2, rows=(1, 3), working_set=1 << 20)
    assert result["threads"] == 1 and result["rows"] == [1, 3]
    assert set(result["dtypes"]) == set(dtypes)
    for report in result["dtypes"].values():
        if "skipped" in report:
            continue
        assert set(report["shapes"]) == set(shapes) and set(report["by_rows"]) == {"M=1", "M=3"}
        for entry in [report, *report["by_rows"].values()]:
            assert entry["plain_gbps"] > 0 and entry["kernel_gbps"] > 0
            assert entry["fraction"] == pytest.approx(entry["kernel_gbps"] / entry["plain_gbps"])
            assert len(entry["fraction_spread"]) == 2
        assert all(s["copies"] >= 2 and s["bytes_per_call"] > 0 for s in report["shapes"].values())


def test_plain_read_rate_is_positive(library):
    assert gemv_bandwidth.plain_read_gb_per_s(1, nbytes=1 << 20, repeats=2) > 0


def test_unknown_dtype_is_refused(library):
    with pytest.raises(ValueError, match="unknown dtype"):
        gemv_bandwidth.measure(1, {"tiny": (64, 128)}, ["float64"], 1, working_set=1 << 16)
