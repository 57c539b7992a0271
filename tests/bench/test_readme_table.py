"""README.md's headline table is bench/results/summary.json's, not typed by hand: the block between
its markers is what bench.headline renders from the committed summary.json (after a full
`make bench`, or `python -m bench.headline`). Runs no benchmark."""

from __future__ import annotations

import copy
import json

import pytest

from bench import headline
from bench.__main__ import parse_args, readme_follows
from bench.output import duration_text
from bench.summary import TARGETS
from tests.bench.checks import REPO_ROOT


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(headline.SUMMARY.read_text(encoding="utf-8"))


def readme_block() -> str:
    return headline.current_block(headline.README.read_text(encoding="utf-8"))


def test_readme_table_is_the_committed_summary(summary):
    assert readme_block() == headline.block(summary), (
        "README.md's headline table differs from bench/results/summary.json: "
        "run `python -m bench.headline`"
    )


@pytest.mark.parametrize("key", sorted({key for row in headline.ROWS for key in row.keys}))
def test_a_changed_figure_fails_the_comparison(summary, key):
    """Self-test: every headline figure shows, so a summary that disagrees is caught (a value
    changed where measured, a figure added where it is not)."""
    changed = copy.deepcopy(summary)
    changed[key] = summary[key] * 1.5 + 0.1 if key in summary else 1.0
    assert readme_block() != headline.block(changed)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["seconds"].update(total=s["seconds"]["total"] + 120),
        lambda s: s["machine"].update(cpu="Some Other CPU"),
        lambda s: s.update(quick=True),
        lambda s: s.update(date="2030-01-01 00:00 UTC"),
    ],
    ids=["duration", "machine", "quick", "date"],
)
def test_a_changed_run_fails_the_comparison(summary, change):
    changed = copy.deepcopy(summary)
    change(changed)
    assert readme_block() != headline.block(changed)


def test_every_row_shows_a_figure_with_a_target():
    keys = [key for row in headline.ROWS for key in row.keys]
    assert len(keys) == len(set(keys)) and len(headline.ROWS) <= 16
    assert set(keys) <= {t.key for t in TARGETS}


def test_values_targets_and_missing_figures():
    summary = {"served_vs_direct": 0.85, "openai_vs_grpc": 0.96, "engine_vs_hf_static": 4.144}
    lines = headline.table(summary)
    assert lines[:2] == ["| figure | value | target |", "|---|---|---|"]
    assert len(lines) == 2 + len(headline.ROWS)
    row = next(line for line in lines if "`served_vs_direct`" in line)
    assert row.endswith("| **0.85x** / 0.96x | >= 0.9 / >= 0.95 |")  # bold: below its target
    row = next(line for line in lines if "`engine_vs_hf_static`" in line)
    assert row.endswith("| 4.14x / not measured | >= 3 / >= 5 |")
    row = next(line for line in lines if "`engine_vs_ctranslate2`" in line)
    assert row.endswith("| not measured | >= 1 |")
    row = next(line for line in lines if "`prefix_cache_ttft_reduction`" in line)
    assert row.endswith("| not measured | >= 0.8 |")
    qos = {"qos_interactive_ttft_p99_vs_alone": 2.5, "qos_embedding_interactive_p99_vs_alone": 1.0}
    row = next(line for line in headline.table(qos) if "`qos_interactive_ttft" in line)
    assert row.endswith("| **2.50x** / not measured / 1.00x | <= 2 / <= 3 / <= 2 |")  # above
    lines = headline.table({"prefix_cache_ttft_reduction": 0.889, "structured_vs_free": 0.5})
    assert any(line.endswith("| 0.89 | >= 0.8 |") for line in lines)  # a fraction, not a ratio
    assert any(line.endswith("| **0.50x** | >= 0.9 |") for line in lines)


def test_the_paragraph_says_what_run_and_wraps_outside_code():
    summary = {
        "machine": {"cpu": "AMD EPYC", "cpu_count": 2, "versions": {"torch": "2.13.0+cpu"}},
        "quick": False,
        "gpu": False,
        "date": "2026-01-02 03:04 UTC",
        "seconds": {"engine": 100.0, "lora": 40.0, "total": 3 * 3600 + 65},
    }
    text = headline.run_text(summary)
    assert "a full run" in text and "written 2026-01-02 03:04 UTC" in text
    assert "2 benchmarks in 3 h 01 min" in text and "AMD EPYC with 2 CPUs" in text
    assert "torch 2.13.0+cpu" in text
    assert "a `--quick` run" in headline.run_text({**summary, "quick": True})
    wrapped = headline.wrap("word " * 30 + "`python -m bench --report-only` end", width=40)
    assert all(line.count("`") % 2 == 0 for line in wrapped.splitlines())
    assert all(len(line) <= 40 for line in wrapped.splitlines() if "`" not in line)
    assert [duration_text(s) for s in (48.4, 1929.97, 3605)] == [
        "48 s",
        "32 min 10 s",
        "1 h 00 min",
    ]


def test_update_rewrites_only_the_block(tmp_path, summary):
    readme = tmp_path / "README.md"
    stale = "\n".join([headline.START, "| old | 1.00x | >= 1 |", headline.END])
    readme.write_text(f"# Title\n\nbefore\n\n{stale}\n\nafter\n", encoding="utf-8")
    assert headline.update_readme(summary, readme) is True
    text = readme.read_text(encoding="utf-8")
    assert text == f"# Title\n\nbefore\n\n{headline.block(summary)}\n\nafter\n"
    assert headline.update_readme(summary, readme) is False
    readme.write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no headline block"):
        headline.update_readme(summary, readme)


def test_check_mode_exits_nonzero_on_a_stale_table(tmp_path, summary):
    readme, path = tmp_path / "README.md", tmp_path / "summary.json"
    readme.write_text(f"x\n{headline.block(summary)}\n", encoding="utf-8")
    path.write_text(json.dumps(summary), encoding="utf-8")
    headline.main(["--check", "--summary", str(path), "--readme", str(readme)])
    path.write_text(json.dumps({**summary, "structured_vs_free": 0.5}), encoding="utf-8")
    with pytest.raises(SystemExit, match="differs"):
        headline.main(["--check", "--summary", str(path), "--readme", str(readme)])


def test_only_a_full_run_into_bench_results_rewrites_the_readme(tmp_path, monkeypatch):
    """`make test` runs the suite with --quick into a temp dir: it must never touch README.md."""
    monkeypatch.chdir(REPO_ROOT)
    assert readme_follows(parse_args([]))
    assert readme_follows(parse_args(["--only", "engine"]))
    assert readme_follows(parse_args(["--report-only"]))
    assert readme_follows(parse_args(["--out-dir", str(REPO_ROOT / "bench" / "results")]))
    assert not readme_follows(parse_args(["--quick"]))
    assert not readme_follows(parse_args(["--out-dir", str(tmp_path)]))
    assert not readme_follows(parse_args(["--quick", "--out-dir", str(tmp_path)]))
    monkeypatch.chdir(tmp_path)  # the default out-dir is relative: another checkout's results
    assert not readme_follows(parse_args([]))
