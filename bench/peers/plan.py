"""What the peer benchmarks share on the benchmark's side: which precisions and thread counts they
run, whether the peers run at all (and why not), the converted models, and the summary figures
(each the worst thread count) with a reason for every figure left out."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from bench import cli
from bench.peers import cache, env
from bench.peers.client import PeerWorker

BF16_NOT_NATIVE = (
    "bfloat16 not run: this CPU has no native bf16 (torch.ops.mkldnn._is_mkldnn_bf16_supported() "
    "is False: no AVX512-BF16/AMX), so every system would emulate it slowly; not comparable "
    "(--dtype bfloat16 runs it anyway)"
)


DTYPE = cli.ByMode(quick="float32", cpu="auto")
"""Both peer benchmarks' --dtype default: float32 under --quick, else "auto" (float32, and bfloat16
where the CPU has it natively: `precisions`)."""


def add_args(parser: argparse.ArgumentParser) -> None:
    """The flags both peer benchmarks take, with their defaults."""
    parser.set_defaults(
        thread_counts=cli.ByMode(quick=[1], cpu=[1, 2]), peers=cli.ByMode(quick=False, cpu=True)
    )
    parser.add_argument(
        "--thread-counts",
        type=lambda s: [int(n) for n in s.split(",")],
        help="thread counts to compare at, each in turn; --threads is not used "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        help="run the peers (builds .venv-peers on first use; default: %(default)s)",
    )


def native_bf16() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def precisions(dtype: str) -> tuple[list[str], dict[str, str]]:
    """The dtypes to run and those left out, with why. "auto": float32, and bfloat16 where the
    CPU has it natively."""
    if dtype == "auto":
        if native_bf16():
            return ["float32", "bfloat16"], {}
        return ["float32"], {"bfloat16": BF16_NOT_NATIVE}
    others = {"float32", "bfloat16"} - {dtype}
    return [dtype], {other: f"{other} not run: --dtype {dtype}" for other in others}


def why_no_peers(args: argparse.Namespace, device) -> str | None:
    """Why the peers do not run in this run; None when they do."""
    if device.type != "cpu":
        return f"the peers are CPU systems: none run on {device}"
    if not args.peers:
        if args.quick:
            return (
                "skipped in --quick mode (what `make test` runs): building .venv-peers costs "
                "minutes; --peers runs them"
            )
        return "skipped: --no-peers"
    return None


def converted_models(targets: dict[str, str], source) -> tuple[dict[str, str], dict[str, str]]:
    """Each system's converted model (system -> path) and the systems that have none (-> why).
    Builds the peers' environment first when needed."""
    try:
        env.ensure()
    except env.PeersUnavailable as exc:
        return {}, dict.fromkeys(targets, str(exc))
    paths, reasons = {}, {}
    for system, target in targets.items():
        try:
            paths[system] = str(cache.converted(target, source))
        except env.PeersUnavailable as exc:
            reasons[system] = str(exc)
    return paths, reasons


def cpu_metered(system: Callable, sink: list[float], source=None) -> Callable:
    """`system` (returning (outputs, seconds)), appending to `sink` the CPU seconds of each run:
    `source.cpu_seconds` (the part it timed), else this process's around the whole call."""

    def run():
        started = time.process_time()
        result = system()
        sink.append(source.cpu_seconds if source else time.process_time() - started)
        return result

    return run


def cores_busy(seconds: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, float]:
    """Each system's median CPU seconds per wall second: the cores it kept busy."""
    return {
        name: statistics.median(c / s for c, s in zip(cpu[name], seconds[name], strict=True))
        for name in seconds
    }


def ratios(seconds: dict[str, list[float]], ours: str) -> dict[str, float]:
    """Each other system's median seconds / ours: how many times faster ours is."""
    mine = statistics.median(seconds[ours])
    return {name: statistics.median(s) / mine for name, s in seconds.items() if name != ours}


def summarize(
    runs: list[dict],
    keys: dict[tuple[str, str], str],
    skipped: dict[str, str],
    no_peers: str | None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Summary figures: for each (peer, dtype) key, its worst ratio over the thread counts run
    (the targets hold at each). A key not measured at every thread count is missing, with why:
    the runs' reasons, else why no peer ran, else why the dtype did not (`skipped`)."""
    summary, missing = {}, {}
    for (peer, dtype), key in keys.items():
        values, reasons = [], {}
        for run in runs:
            if run["dtype"] != dtype:
                continue
            if peer in run["ratio_vs_ours"]:
                values.append(run["ratio_vs_ours"][peer])
            else:
                reasons[run["threads"]] = run["excluded"].get(peer, "not run")
        if values and not reasons:
            summary[key] = min(values)
        elif len(set(reasons.values())) == 1 and not values:
            missing[key] = next(iter(reasons.values()))
        else:
            missing[key] = (
                "; ".join(f"{n} thread(s): {why}" for n, why in reasons.items())
                or no_peers
                or skipped.get(dtype, "not run")
            )
    return summary, missing


def missing_lines(result: dict) -> list[str]:
    """Report lines: the summary keys left out, grouped by why."""
    keys_by_reason: dict[str, list[str]] = {}
    for key, why in result["missing"].items():
        keys_by_reason.setdefault(why, []).append(f"`{key}`")
    return [f"- {', '.join(keys)} not measured: {why}" for why, keys in keys_by_reason.items()]


def measure_all(
    args: argparse.Namespace,
    device,
    model_dir,
    conversions,
    keys,
    measure: Callable[[int, str, PeerWorker | None, dict[str, str]], dict],
    variants: dict[str, tuple[str, ...]] | None = None,
) -> dict:
    """Every thread count x precision: `measure(threads, dtype, worker, converted model paths)`
    with one peer worker per thread count (none when the peers do not run). `variants`: labels
    measured right after a precision (e.g. "kv-int8" after "float32"), skipped with it and when
    no peer runs.
    Returns the result fields both peer benchmarks share: runs, summary figures, and what was
    skipped and why."""
    dtypes, skipped = precisions(args.dtype)
    no_peers = why_no_peers(args, device)
    for dtype, labels in (variants or {}).items():
        if dtype in dtypes and not no_peers:
            dtypes = [label for d in dtypes for label in ((d, *labels) if d == dtype else (d,))]
        else:  # skipped with its precision, or (a comparison) when no peer runs
            skipped.update(dict.fromkeys(labels, no_peers or skipped.get(dtype, "not run")))
    runs: list[dict] = []
    paths: dict[str, str] = {}
    reasons = dict.fromkeys(conversions, no_peers) if no_peers else {}
    if device.type == "cpu":
        if not no_peers:
            paths, reasons = converted_models(conversions, model_dir)
        for threads in args.thread_counts:
            worker = PeerWorker(threads) if paths else None
            try:
                for dtype in dtypes:
                    run = measure(threads, dtype, worker, paths)
                    run["excluded"] = {**reasons, **run["excluded"]}
                    runs.append(run)
            finally:
                if worker:
                    worker.close()
    summary, missing = summarize(runs, keys, skipped, no_peers)
    return {
        "dtype": ",".join(dtypes),
        "thread_counts": args.thread_counts,
        "skipped_dtypes": skipped,
        "peers": {"run": not no_peers, "reason": no_peers, "models": paths, "unavailable": reasons},
        "runs": runs,
        "summary": summary,
        "missing": missing,
    }


# --- report ----------------------------------------------------------------------------------


def system_rows(
    result: dict, rate_key: str, check_key: str, check_text: Callable[[object], str]
) -> list[str]:
    """One table row per (thread count, dtype, system): its rate (`run[rate_key]`, {"min",
    "median", "max"}), ours / it, cores busy, and its output check (`run[check_key]`, shown by
    `check_text`); a system whose check failed is listed as not timed."""
    rows = []
    for run in result["runs"]:
        lead = f"| {run['threads']} | {run['dtype']} |"
        for name, check in run[check_key].items():
            if name not in run[rate_key]:
                rows.append(f"{lead} {name} | not timed |  |  | {check_text(check)} |")
        for name, rate in run[rate_key].items():
            ratio, check = run["ratio_vs_ours"].get(name), run[check_key].get(name)
            cores = run.get("cores_busy", {}).get(name)
            rows.append(
                f"{lead} {name} | {rate['median']:.1f} ({rate['min']:.1f}-{rate['max']:.1f}) | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'' if cores is None else f'{cores:.2f}'} | "
                f"{'' if check is None else check_text(check)} |"
            )
    return rows


def summary_lines(result: dict) -> list[str]:
    """The figures left out (with why) and each summary figure with a target against it (one
    without, e.g. quantized_engine's weight bytes, is in its benchmark's own lines)."""
    from bench.summary import TARGETS

    targets = {t.key: t.minimum for t in TARGETS}
    lines = missing_lines(result)
    for key, value in result["summary"].items():
        if key not in targets:
            continue
        met = "met" if value >= targets[key] else "NOT met"
        lines.append(
            f"- `{key}` (worst thread count): **{value:.2f}x** (target >= {targets[key]:g}x: {met})"
        )
    return lines
