"""Every benchmark module has the shared interface and states its own defaults; runs nothing."""

from __future__ import annotations

import argparse
import importlib
import types
from pathlib import Path

import pytest

from bench import cli
from bench.__main__ import BENCHMARKS

pytestmark = pytest.mark.bench
MODULES = [bench.name for bench in BENCHMARKS] + ["kernels"]


@pytest.mark.parametrize("name", MODULES)
def test_module_has_the_interface_and_its_own_defaults(name):
    module = importlib.import_module(f"bench.{name}")
    assert name == module.NAME
    for function in ("add_args", "run", "report", "plot", "main"):
        assert callable(getattr(module, function)), function
    args = cli.parse_args(module, ["--quick"])
    assert args.quick and args.out == Path(f"bench/results/{name}.json")
    for flag in cli.OWN_DEFAULTS:
        assert getattr(args, flag) is not None, flag
    assert not any(isinstance(v, cli.ByMode) for v in vars(args).values())


def test_mode_dependent_defaults_follow_quick_and_device():
    module = importlib.import_module("bench.rerank")
    assert cli.parse_args(module, ["--quick"]).texts == 24
    assert cli.parse_args(module, ["--device", "cpu"]).texts == 96
    assert cli.parse_args(module, ["--device", "cuda"]).texts == 4096
    assert cli.parse_args(module, ["--device", "cuda", "--texts", "7"]).texts == 7


def test_a_benchmark_must_state_its_defaults():
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(dtype="auto", threads=0)  # no repeats

    module = types.ModuleType("bench.incomplete", "An incomplete benchmark.")
    module.NAME, module.add_args = "incomplete", add_args
    module.__spec__ = importlib.machinery.ModuleSpec("bench.incomplete", None)
    with pytest.raises(TypeError, match="repeats"):
        cli.parse_args(module, [])
