"""`make bench`: every benchmark in one run, then `summary.json`, a Markdown report and PNG plots.

Each benchmark runs alone in its own process (`python -m bench.<name> --out ...`, forked from
the suite once it has imported the heavy libraries: bench/forked_module.py), one after another,
so none competes with another for the CPU. Then each module's `Benchmark`
(bench.skeleton) gives its report section and its plots. Results land in `--out-dir` (default
bench/results/):

    <name>.json     one per benchmark (raw repeats, settings, machine)
    summary.json    the headline figures (the keys below), machine, versions, date and the
                    seconds each benchmark took ("total": the whole run)
    report.md       the run's duration, summary table against the targets, then one section per
                    benchmark
    <name>_*.png    plots

Into the default bench/results/ and not --quick, the run also rewrites README.md's headline table
from the summary.json it wrote (bench.headline; `python -m bench.headline` does that alone).
The suite prints each benchmark's seconds as it finishes and its own wall time at the end.

    python -m bench [--quick] [--gpu] [--only engine,prefix_cache] [--out-dir DIR] [--report-only]

--quick runs every benchmark at tiny sizes (what `make test` checks: it runs and writes valid
results; its figures mean nothing). --gpu runs the GPU mode: CUDA, bfloat16, the benchmarks'
larger models and the Triton kernels.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import headline
from bench.forked_module import ForkedModule, warm_up
from bench.output import duration_text, machine_info, progress, write_result
from bench.skeleton import load
from bench.summary import (
    TARGETS,
    collect_missing,
    collect_summary,
    missed_targets,
    not_measured,
    summary_table,
)
from tooling.child_process import die_with_parent, stop_on_signals

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = Path("bench/results")


@dataclass(frozen=True)
class SuiteEntry:
    """One benchmark's place in the suite."""

    name: str
    """`python -m bench.<name>` writes <name>.json."""
    title: str
    """Its progress line, and its report section's heading should its report fail."""
    full_args: tuple[str, ...] = ()
    """Arguments of the full (CPU) run, chosen so that the whole suite fits in 100 minutes on 2
    cores (the last run's seconds: summary.json's "seconds")."""


# Every benchmark runs with one torch thread (the servers too, through OMP_NUM_THREADS): on a
# 2-core machine two OpenMP threads stall whenever anything else takes a core, which made repeated
# runs differ several-fold; one thread gives steady ratios, and both sides of each ratio get it.
BENCHMARKS = (
    SuiteEntry("engine", "LLM engine vs transformers", ("--repeats", "1")),
    SuiteEntry("moe_engine", "Mixture-of-experts engine vs transformers"),
    SuiteEntry("parallel", "Tensor and pipeline parallelism: TP=2 and PP=2 vs TP=1"),
    SuiteEntry("engine_peers", "LLM engine vs OpenVINO GenAI and CTranslate2 (CPU)"),
    SuiteEntry("quantized_engine", "W4A16 checkpoint vs bfloat16 and OpenVINO GenAI int4"),
    SuiteEntry("real_sizes", "Real sizes: a 1B Llama vs OpenVINO GenAI and llama.cpp (CPU)"),
    SuiteEntry(
        "gguf_perplexity", "GGUF perplexity: the engine vs llama.cpp on the same files (CPU)"
    ),
    SuiteEntry("batching_spread", "Continuous vs static batching"),
    SuiteEntry("prefix_cache", "Prefix caching"),
    SuiteEntry("kv_offload", "KV offload tier: multi-turn agents, tier on vs off"),
    SuiteEntry("kv_routing", "Cache-aware routing on KV events: 3 replicas"),
    SuiteEntry("kv_memory", "KV memory"),
    SuiteEntry("preemption", "Preemption: recompute vs swap"),
    SuiteEntry("qos", "Mixed traffic: interactive requests beside a batch flood"),
    SuiteEntry("lora", "Multi-LoRA: adapters + base vs base alone"),
    SuiteEntry("serving", "Serving through tritonserver"),
    SuiteEntry(
        "embedding", "Embedding vs sentence-transformers", ("--texts", "250", "--repeats", "3")
    ),
    SuiteEntry("embedding_peers", "Embedding vs OpenVINO and ONNX Runtime (CPU)"),
    SuiteEntry("rerank", "Rerank vs CrossEncoder"),
    SuiteEntry("decoder_retrieval", "Decoder embedder and reranker vs sentence-transformers"),
    SuiteEntry("encoders_served", "Embedding and rerank through tritonserver"),
    SuiteEntry("openai_frontend", "OpenAI frontend vs gRPC"),
    SuiteEntry("structured_outputs", "Structured outputs: constrained vs free"),
    SuiteEntry("spec_decode", "Speculative decoding: n-gram vs plain"),
    SuiteEntry("multimodal", "Images: a vision-language model vs transformers generate"),
)


def benchmark_args(bench: SuiteEntry, quick: bool, gpu: bool) -> list[str]:
    args = ["--quick"] if quick else list(bench.full_args)
    if gpu:
        args += ["--device", "cuda", "--dtype", "bfloat16"]
    else:
        args += ["--threads", "1"]
    return args


def run_benchmark(bench: SuiteEntry, out: Path, args: list[str], timeout: float) -> str | None:
    """Run one benchmark in its own process; None on success, else what went wrong."""
    module, argv = f"bench.{bench.name}", ["--out", str(out.resolve()), *args]
    progress(f"{bench.name}: -m {module} {' '.join(argv)}")
    log_path = out.with_suffix(".log")
    with log_path.open("w", encoding="utf-8") as log:
        # Output goes to the log and, line by line, to our stderr: progress stays visible.
        # A killed suite takes its benchmark (and its servers) along.
        proc = ForkedModule(module, argv, cwd=REPO_ROOT, preexec=die_with_parent())
        # A silent, hung benchmark must not hang the suite: a timer kills it.
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                print(f"  {bench.name}| {line}", end="", file=sys.stderr, flush=True)
            code = proc.wait()
        except BaseException:  # SIGTERM (SystemExit) or SIGINT: the benchmark stops too
            _stop(proc)
            raise
        finally:
            timed_out = not watchdog.is_alive()
            watchdog.cancel()
    if timed_out:
        return f"timed out after {timeout:.0f} s (log: {log_path})"
    if code != 0:
        return f"exited with {code} (log: {log_path})"
    if not out.exists():
        return f"wrote no result (log: {log_path})"
    return None


def _stop(proc: ForkedModule, grace_s: float = 30.0) -> None:
    """SIGTERM a benchmark (it stops its servers on the way out), SIGKILL past `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Outcome:
    """What the benchmarks left: each one's result, or why it has none, and the seconds it took."""

    results: dict[str, dict] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def read(self, bench: SuiteEntry, out: Path, error: str | None) -> None:
        """Record the result at `out`, or `error`."""
        if error is None:
            self.results[bench.name] = json.loads(out.read_text(encoding="utf-8"))
        else:
            self.failures[bench.name] = error
            progress(f"{bench.name} FAILED: {error}")


def run_all(selected: list[SuiteEntry], args: argparse.Namespace) -> Outcome:
    """Each selected benchmark in turn, in its own process."""
    warm_up()
    outcome = Outcome()
    for index, bench in enumerate(selected, 1):
        out = args.out_dir / f"{bench.name}.json"
        progress(f"[{index}/{len(selected)}] {bench.title}")
        started = time.monotonic()
        error = run_benchmark(bench, out, benchmark_args(bench, args.quick, args.gpu), args.timeout)
        outcome.seconds[bench.name] = time.monotonic() - started
        progress(f"{bench.name}: finished in {outcome.seconds[bench.name]:.0f} s")
        outcome.read(bench, out, error)
    return outcome


def read_all(selected: list[SuiteEntry], out_dir: Path) -> Outcome:
    """The results already in `out_dir` (--report-only), with the seconds of the run that wrote
    them."""
    outcome = Outcome()
    for bench in selected:
        out = out_dir / f"{bench.name}.json"
        outcome.read(bench, out, None if out.exists() else f"no result {out}")
    previous = out_dir / "summary.json"
    if previous.exists():
        outcome.seconds = json.loads(previous.read_text(encoding="utf-8"))["seconds"]
    return outcome


def make_plots(out_dir: Path, results: dict[str, dict]) -> dict[str, list[Path]]:
    plots: dict[str, list[Path]] = {}
    for name, result in results.items():
        try:
            plots[name] = list(load(name).plot(result, out_dir))
        except Exception as exc:
            progress(f"{name}: plot() failed: {exc!r}")
    return plots


def section(bench: SuiteEntry, result: dict, plots: list[Path]) -> list[str]:
    """The benchmark's section of the report, and a link to each of its plots."""
    try:
        lines = load(bench.name).section(result)
    except Exception as exc:  # a broken report of one benchmark must not lose the others
        lines = [f"### {bench.title}", "", f"report() failed: {exc!r}"]
    return [*lines, "", *(f"![{p.stem}]({p.name})" for p in plots), ""]


def duration_lines(seconds: dict[str, float]) -> list[str]:
    """The report's record of how long the run took: in all, and each benchmark."""
    total = seconds.get("total")
    rows = [f"| `{name}` | {s:.0f} |" for name, s in seconds.items() if name != "total"]
    return [
        "## Duration",
        "",
        f"{headline.plural(len(rows), 'benchmark')} in "
        f"{'(not recorded)' if total is None else duration_text(total)} "
        "(summary.json: `seconds`; each benchmark includes its process start and model loads).",
        "",
        "| benchmark | seconds |",
        "|---|---|",
        *rows,
        "",
    ]


def write_report(
    args: argparse.Namespace,
    outcome: Outcome,
    figures: dict[str, float],
    missing: dict[str, str],
    plots: dict[str, list[Path]],
    summary: dict,
) -> Path:
    mode = "quick (tiny sizes: the figures mean nothing)" if args.quick else "full"
    machine, total = summary["machine"], summary["seconds"].get("total")
    lines = [
        "# Benchmark report",
        "",
        f"Produced by `python -m bench{' --quick' if args.quick else ''}"
        f"{' --gpu' if args.gpu else ''}` ({mode}) on {summary['date']}"
        f"{', from the results already there (--report-only)' if args.report_only else ''}.",
        f"Machine: {machine.get('gpu') or machine.get('cpu')}, {machine.get('cpu_count')} CPUs, "
        f"torch {machine['versions'].get('torch')}, transformers {machine['versions'].get('transformers')}.",
        f"Duration: {'not recorded' if total is None else duration_text(total)} "
        "(each benchmark's: under Duration below).",
        "",
        "## Summary",
        "",
        *summary_table(figures),
        "",
        *missed_targets(figures),
        *not_measured(missing),
        *duration_lines(summary["seconds"]),
    ]
    if outcome.failures:
        lines += ["## Failed benchmarks", ""]
        lines += [f"- `{name}`: {why}" for name, why in outcome.failures.items()]
        lines.append("")
    for bench in BENCHMARKS:
        if bench.name in outcome.results:
            lines += section(bench, outcome.results[bench.name], plots.get(bench.name, []))
    path = args.out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def run(args: argparse.Namespace) -> dict:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    selected = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    suite_started = time.monotonic()
    outcome = read_all(selected, args.out_dir) if args.report_only else run_all(selected, args)
    figures, sources = collect_summary(outcome.results)
    missing = collect_missing(outcome.results, figures)
    plots = make_plots(args.out_dir, outcome.results)
    machine = machine_info()
    summary = {
        **figures,
        "machine": machine,
        "versions": machine["versions"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "gpu": args.gpu,
        "targets": {t.key: t.minimum for t in TARGETS},
        "targets_at_most": [t.key for t in TARGETS if t.at_most],
        "sources": sources,
        "missing": missing,
        "failed": outcome.failures,
        "seconds": outcome.seconds
        if args.report_only
        else {**outcome.seconds, "total": time.monotonic() - suite_started},
    }
    write_result(args.out_dir / "summary.json", summary)
    report = write_report(args, outcome, figures, missing, plots, summary)
    print(f"wrote {report}")
    if readme_follows(args):
        try:
            changed = headline.update_readme(summary)
            print(f"{'rewrote' if changed else 'unchanged:'} {headline.README}'s headline table")
        except ValueError as exc:  # the results are written: say what is wrong, lose nothing
            progress(f"README headline table not written: {exc}")
    print("\n".join(summary_table(figures)))
    total = summary["seconds"].get("total")
    took = "(not recorded)" if total is None else duration_text(total)
    ran = "the run that wrote these results" if args.report_only else "this run"
    print(f"duration: {ran} took {took} (summary.json: seconds)")
    return summary


def readme_follows(args: argparse.Namespace) -> bool:
    """Whether this run rewrites README.md's headline table: only a full (not --quick) run into
    the default bench/results/ of this checkout, whose summary.json the README quotes."""
    return not args.quick and args.out_dir.resolve() == (REPO_ROOT / DEFAULT_OUT_DIR).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--gpu", action="store_true", help="CUDA, bfloat16, larger models")
    parser.add_argument(
        "--only",
        type=lambda s: set(s.split(",")),
        default=None,
        help="comma-separated benchmark names (default: all): "
        + ",".join(b.name for b in BENCHMARKS),
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="where results go (default bench/results/, whose summary.json README.md quotes)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild summary, report, plots (and README's table, for the default "
        "--out-dir) from the JSONs in --out-dir",
    )
    args = parser.parse_args(argv)
    unknown = (args.only or set()) - {b.name for b in BENCHMARKS}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    stop_on_signals()
    summary = run(parse_args(argv))
    if summary["failed"]:
        raise SystemExit(f"failed: {', '.join(summary['failed'])}")


if __name__ == "__main__":
    main()
