"""A benchmark's skeleton: each module declares what is its own in one `Benchmark` (its defaults
and flags, its measurement, its report section, its plots); what every benchmark does alike is
here, done once:

    python -m bench.<name>: the common flags (bench.cli) and its own -> `run` in a scratch
    directory -> the result, with the fields every result has -> its report section on stdout
    -> the result as JSON (--out)

The suite (`python -m bench`) reads the same `Benchmark` of each module (`load`) for the
report's sections and the plots.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import cli
from bench.output import machine_info, write_result
from tooling.child_process import stop_on_signals

Run = Callable[[argparse.Namespace, Path], dict]
"""`run(args, scratch)`: the measurement, the result's own fields. `scratch` is an empty
temporary directory for what it builds (checkpoints, model repositories), removed afterwards."""
Report = Callable[[dict], list[str]]
"""`report(result)`: the Markdown lines of its report section, under the heading."""
Plot = Callable[[dict, Path], list[Path]]
"""`plot(result, out_dir)`: the PNGs it wrote to out_dir, each named <name>_*.png."""


def no_plots(result: dict, out_dir: Path) -> list[Path]:
    """The plot of a benchmark whose few numbers read better in its table."""
    return []


def no_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a benchmark that has only the common ones."""


@dataclass(frozen=True)
class Benchmark:
    """What one benchmark module declares; `main` runs it."""

    name: str
    """`python -m bench.<name>`; its result is <name>.json."""
    heading: str
    """Its report section's heading."""
    doc: str
    """The module's docstring; its first paragraph describes the command."""
    defaults: cli.Defaults
    """Its defaults for --dtype, --threads and --repeats."""
    run: Run
    report: Report
    plot: Plot = no_plots
    add_args: Callable[[argparse.ArgumentParser], None] = no_flags
    """Its own flags (and their defaults)."""
    recorded_as: str = ""
    """The result's "benchmark" field, when not `name`."""

    def main(self, argv: list[str] | None = None) -> dict:
        """Parse the arguments, run, print the report section, write the result to --out. SIGTERM
        ends it through SystemExit, so the servers it started stop."""
        stop_on_signals()
        args = self.parse_args(argv)
        result = self.measure(args)
        print("\n".join(self.section(result)))
        write_result(args.out, result)
        return result

    def parse_args(self, argv: list[str] | None = None) -> argparse.Namespace:
        """The common flags with its defaults, and its own flags; the defaults that depend on the
        run (`cli.ByMode`) resolved."""
        parser = argparse.ArgumentParser(
            prog=f"python -m bench.{self.name}", description=self.doc.split("\n\n")[0]
        )
        cli.add_cli_args(parser, self.name)
        parser.set_defaults(**vars(self.defaults))  # not asdict: it would unpack a ByMode
        self.add_args(parser)
        return cli.resolve_by_mode(parser.parse_args(argv))

    def measure(self, args: argparse.Namespace) -> dict:
        """`run` in a fresh scratch directory; its fields after those every result starts with
        (which benchmark, whether --quick), and the machine it ran on unless `run` recorded it."""
        with tempfile.TemporaryDirectory(prefix=f"bench-{self.name}-") as scratch:
            own = self.run(args, Path(scratch))
        result = {"benchmark": self.recorded_as or self.name, "quick": args.quick, **own}
        result.setdefault("machine", machine_info())
        return result

    def section(self, result: dict) -> list[str]:
        """Its report section: the heading, then `report`'s lines."""
        return [f"### {self.heading}", "", *self.report(result)]


def load(name: str) -> Benchmark:
    """The `Benchmark` that module bench.<name> declares."""
    return importlib.import_module(f"bench.{name}").BENCHMARK
