"""bench.qos's embedding half: single short texts (interactive) beside a flood of large embedding
requests, through the embedding service's micro-batch scheduler (backend_lib/encoder/scheduler.py)
on its own thread, as model.py runs it.

Modes: alone (the interactive requests only), fcfs (everything at priority 0: arrival order) and
priority (the flood at priority 1). Interactive requests arrive at a steady rate over 60% of the
flood's own duration (measured first, which also warms up). Latency is from submit to answer.
Each interactive vector must equal alone's (cosine >= COSINE_GATE) before any figure is kept.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import cli
from bench.encoders import DEFAULT_MODEL, mixed_texts
from bench.output import progress
from bench.summary import summary_line, target_of
from bench.timing import p50_p99_ms, percentile

KEY = "qos_embedding_interactive_p99_vs_alone"
FCFS_KEY = "qos_embedding_fcfs_interactive_p99_vs_alone"
MODES = ("alone", "fcfs", "priority")
COSINE_GATE = 0.99999
ARRIVAL_WINDOW = 0.6


@dataclass(frozen=True)
class Flood:
    requests: int
    texts_per_request: int
    interactive: int


PRESETS = {"quick": Flood(2, 8, 4), "cpu": Flood(8, 64, 24), "cuda": Flood(64, 256, 64)}


@dataclass
class Submission:
    at: float
    texts: list[str]
    priority: int
    interactive: bool


def make_submissions(flood: Flood, interval: float, seed: int, priority: int) -> list[Submission]:
    long_texts = [
        t
        for t in mixed_texts(flood.requests * flood.texts_per_request * 3, seed)
        if len(t.split()) >= 60
    ]
    n = flood.texts_per_request
    batches = [
        Submission(0.0, long_texts[k * n : (k + 1) * n], priority, False)
        for k in range(flood.requests)
    ]
    short = [" ".join(t.split()[:8]) for t in mixed_texts(flood.interactive, seed + 1)]
    users = [Submission(0.3 + k * interval, [text], 0, True) for k, text in enumerate(short)]
    return batches + users


def drive(service, submissions: list[Submission]) -> tuple[list[float], list[np.ndarray], float]:
    """Submit each at its time; (interactive latencies in seconds, their vectors in order, seconds
    until the flood's last request was answered)."""
    from backend_lib.contract import PRIORITY

    done = threading.Semaphore(0)
    answers: dict[int, tuple[float, object]] = {}

    def on_done(index: int):
        def answer(result) -> None:
            answers[index] = (time.monotonic(), result)
            done.release()

        return answer

    start = time.monotonic()
    sent: dict[int, float] = {}
    order = sorted(range(len(submissions)), key=lambda i: submissions[i].at)
    for index in order:
        sub = submissions[index]
        time.sleep(max(0.0, start + sub.at - time.monotonic()))
        inputs = {
            "text_input": np.array([[t.encode()] for t in sub.texts], dtype=object),
            PRIORITY: np.array([[sub.priority]], dtype=np.int32),
        }
        sent[index] = time.monotonic()
        service.submit(inputs, on_done(index))
    for _ in submissions:
        done.acquire()
    for index, (_, result) in answers.items():
        if isinstance(result, Exception):
            raise SystemExit(f"embedding request {index} failed: {result}")
    users = [i for i in range(len(submissions)) if submissions[i].interactive]
    flood = [i for i in range(len(submissions)) if not submissions[i].interactive]
    latency = [answers[i][0] - sent[i] for i in users]
    vectors = [answers[i][1]["embedding"][0] for i in users]
    flood_seconds = max((answers[i][0] - start for i in flood), default=0.0)
    return latency, vectors, flood_seconds


def embedding_qos(args: argparse.Namespace, device) -> dict:
    """The embedding half's result and summary figures."""
    from backend_lib.checkpoint import resolve_model_path
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder
    from backend_lib.encoder.service import EmbeddingService, priority_lane

    flood = PRESETS[cli.mode(args.quick, device)]
    model_dir = resolve_model_path(DEFAULT_MODEL, Path.cwd())
    config = EmbeddingConfig(model=str(model_dir), dtype="float32")
    embedder = Embedder.from_config(config, device, Path.cwd())
    # As EmbeddingService.from_context builds it: with the priority lane of its config.
    service = EmbeddingService(
        embedder, lane=priority_lane(config.priority_lane_tokens, embedder.encoder)
    )
    service.start()
    try:
        flood_only = [s for s in make_submissions(flood, 0.0, args.seed, 0) if not s.interactive]
        _, _, flood_seconds = drive(service, flood_only)
        interval = ARRIVAL_WINDOW * flood_seconds / flood.interactive
        progress(
            f"embedding flood alone: {flood_seconds:.1f} s; an interactive request every "
            f"{interval:.2f} s"
        )
        runs: dict[str, list] = {m: [] for m in MODES}
        for rep in range(args.repeats):
            for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                subs = make_submissions(flood, interval, args.seed, int(mode == "priority"))
                if mode == "alone":
                    subs = [s for s in subs if s.interactive]
                runs[mode].append(drive(service, subs))
                progress(
                    f"embedding repeat {rep + 1} {mode}: latency p99 "
                    f"{percentile(runs[mode][-1][0], 99) * 1e3:.0f} ms"
                )
        fidelity = check_vectors(runs)
    finally:
        service.shutdown()
    latency = {m: p50_p99_ms([t for r in rs for t in r[0]]) for m, rs in runs.items()}
    batch = service.embedder.max_batch_tokens
    return {
        "result": {
            "model": DEFAULT_MODEL,
            "flood": {
                "requests": flood.requests,
                "texts_per_request": flood.texts_per_request,
                "flood_alone_s": flood_seconds,
            },
            "interactive": {"requests": flood.interactive, "interval_s": interval, "words": 8},
            "max_batch_tokens": batch,
            "priority_lane_tokens": service.lane.tokens,
            "latency_ms": latency,
            "flood_seconds": {
                m: statistics.median(r[2] for r in rs) for m, rs in runs.items() if m != "alone"
            },
            "fidelity": fidelity,
        },
        "summary": {
            KEY: latency["priority"]["p99"] / latency["alone"]["p99"],
            FCFS_KEY: latency["fcfs"]["p99"] / latency["alone"]["p99"],
        },
    }


def check_vectors(runs: dict[str, list]) -> dict:
    """Every interactive vector of every run equals alone's first run's."""
    reference = runs["alone"][0][1]
    worst = 1.0
    for rs in runs.values():
        for _, vectors, _ in rs:
            for a, b in zip(reference, vectors, strict=True):
                worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    if worst < COSINE_GATE:
        raise SystemExit(f"interactive embeddings differ between modes: min cosine {worst:.7f}")
    return {"min_cosine": worst, "gate": COSINE_GATE, "passed": True}


def embedding_report(result: dict) -> list[str]:
    f, i = result["flood"], result["interactive"]
    lines = [
        f"Embeddings ({result['model']}): {f['requests']} requests of {f['texts_per_request']} "
        f"long texts at once; {i['requests']} single {i['words']}-word texts, one every "
        f"{i['interval_s']:.2f} s; micro-batches of at most {result['max_batch_tokens']} padded "
        f"tokens, the priority lane's of {result['priority_lane_tokens']}; interactive vectors "
        "identical in every mode.",
        "",
        "| mode | interactive latency p50 / p99 (ms) | flood done after (s) |",
        "|---|---|---|",
    ]
    for m in MODES:
        lat, flood_s = result["latency_ms"][m], result["flood_seconds"].get(m)
        shown = "-" if flood_s is None else f"{flood_s:.1f}"
        lines.append(f"| {m} | {lat['p50']:.0f} / {lat['p99']:.0f} | {shown} |")
    goal = target_of(KEY)
    value = result["latency_ms"]["priority"]["p99"] / result["latency_ms"]["alone"]["p99"]
    return [*lines, "", summary_line(KEY, value, goal.text, goal.met(value))]
