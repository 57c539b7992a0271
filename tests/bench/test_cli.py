"""Every benchmark module declares its `Benchmark` (bench.skeleton) with its own defaults, and the
shared command line resolves them; runs nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from bench import cli
from bench.__main__ import BENCHMARKS
from bench.skeleton import Benchmark, load, no_flags

pytestmark = pytest.mark.bench
MODULES = [bench.name for bench in BENCHMARKS] + ["kernels"]


@pytest.mark.parametrize("name", MODULES)
def test_module_declares_its_benchmark_and_its_own_defaults(name):
    benchmark = load(name)
    assert isinstance(benchmark, Benchmark) and benchmark.name == name
    args = benchmark.parse_args(["--quick"])
    assert args.quick and args.out == Path(f"bench/results/{name}.json")
    for flag in ("dtype", "threads", "repeats"):
        assert getattr(args, flag) is not None, flag
    assert not any(isinstance(v, cli.ByMode) for v in vars(args).values())


def test_mode_dependent_defaults_follow_quick_and_device():
    rerank = load("rerank")
    assert rerank.parse_args(["--quick"]).texts == 24
    assert rerank.parse_args(["--device", "cpu"]).texts == 96
    assert rerank.parse_args(["--device", "cuda"]).texts == 4096
    assert rerank.parse_args(["--device", "cuda", "--texts", "7"]).texts == 7


def test_a_benchmark_must_state_its_defaults():
    with pytest.raises(TypeError, match="repeats"):
        cli.Defaults("auto", threads=0)


def _toy(own_flags=no_flags, scratches: list[Path] | None = None) -> Benchmark:
    def run(args: argparse.Namespace, scratch: Path) -> dict:
        assert scratch.is_dir() and not any(scratch.iterdir())
        (scratch / "built").write_text("x")
        (scratches if scratches is not None else []).append(scratch)
        return {"device": "cpu", "seconds": [1.0], "summary": {"toy_ratio": 2.0}}

    return Benchmark(
        "toy",
        "A toy",
        "A toy benchmark.\n\nMore.",
        cli.Defaults("float32", threads=1, repeats=cli.ByMode(quick=1, cpu=3)),
        run,
        lambda result: [f"{result['summary']['toy_ratio']}x"],
        add_args=own_flags,
    )


def test_main_writes_the_result_with_the_fields_every_result_has(tmp_path, capsys):
    out, scratches = tmp_path / "toy.json", []
    result = _toy(scratches=scratches).main(["--quick", "--out", str(out)])
    assert not scratches[0].exists()  # the scratch directory is gone once the run returns
    assert list(result)[:2] == ["benchmark", "quick"]
    assert (result["benchmark"], result["quick"], result["seconds"]) == ("toy", True, [1.0])
    assert "cpu_count" in result["machine"]
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert capsys.readouterr().out.startswith("### A toy\n\n2.0x\n")


def test_a_run_may_record_its_own_machine_and_name():
    toy = dataclasses.replace(
        _toy(), run=lambda args, scratch: {"machine": {"mine": 1}}, recorded_as="toy_v1"
    )
    result = toy.measure(toy.parse_args(["--quick"]))
    assert result == {"benchmark": "toy_v1", "quick": True, "machine": {"mine": 1}}


def test_own_flags_and_by_mode_defaults_resolve():
    def own_flags(parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(items=cli.ByMode(quick=2, cpu=20))
        parser.add_argument("--items", type=int)

    toy = _toy(own_flags)
    assert (toy.parse_args(["--quick"]).items, toy.parse_args(["--quick"]).repeats) == (2, 1)
    args = toy.parse_args(["--device", "cpu"])
    assert (args.items, args.repeats, args.threads, args.dtype) == (20, 3, 1, "float32")
