"""Embedding and rerank through tritonserver with concurrent HTTP clients, against
sentence-transformers in this process on the same inputs.

Starts a real tritonserver on a temporary repository holding an `embedding` model
(all-MiniLM-L6-v2) and a `rerank` model (the cross-encoder tooling.checkpoints.build_cross_encoder
makes: MiniLM encoder plus a seeded random head, since no cross-encoder weights are available
offline). `--clients` threads send requests (embedding: `--request-size` texts each; rerank: one
query with its documents each) until all inputs are done. The first requests' outputs are
checked against `SentenceTransformer.encode` / `CrossEncoder.predict` before timing, and every
timed run's outputs after it. Served and in-process runs alternate, `--repeats` times. Figures:
items/s and tokens/s (min/median/max), served per-request latency p50/p99, and how many requests
the server's micro-batches held (its Prometheus metrics).

    python -m bench.encoders_served [--quick] [--texts 128] [--pairs 96] [--clients 16]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import cli
from bench.encoders import (
    DEFAULT_MODEL,
    DOCUMENTS_PER_QUERY,
    add_min_cosine_flag,
    cosine_gate,
    max_score_error,
    min_cosine,
    mixed_texts,
    reference_model,
    rerank_pairs,
    score_tolerance,
)
from bench.output import progress
from bench.rerank import HEAD_STD
from bench.server import instance_kind, tritonserver
from bench.skeleton import Benchmark
from bench.timing import percentile, rates, time_repeats
from tooling.checkpoints import build_cross_encoder

NAME = "encoders_served"
HEADING = "Encoders served: tritonserver (HTTP, concurrent clients) vs sentence-transformers"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
CHECK_ITEMS = 64
"""Items checked against sentence-transformers before timing (every timed output is checked too)."""


@dataclass
class ServedRun:
    """Outputs in input order, per-request latencies and the wall time of one served pass."""

    outputs: np.ndarray
    latencies: list[float]
    seconds: float


def _bytes_tensor(name: str, values: list[str]):
    import tritonclient.http as httpclient

    data = np.array([v.encode() for v in values], dtype=object).reshape(-1, 1)
    tensor = httpclient.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def served_pass(
    url: str, model: str, output: str, requests: list[dict[str, list[str]]], clients: int
) -> ServedRun:
    """Send `requests` ({input name: strings}) from `clients` threads, each taking the next
    request when its last one answered."""
    import tritonclient.http as httpclient

    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(requests)):
        todo.put(index)
    results: dict[int, np.ndarray] = {}
    latencies: dict[int, float] = {}
    errors: list[BaseException] = []

    def client_loop() -> None:
        client = httpclient.InferenceServerClient(url, connection_timeout=300, network_timeout=300)
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            inputs = [_bytes_tensor(name, values) for name, values in requests[index].items()]
            started = time.perf_counter()
            try:
                results[index] = client.infer(model, inputs).as_numpy(output)
            except BaseException as exc:  # reported after the run
                errors.append(exc)
                return
            latencies[index] = time.perf_counter() - started

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} {model} requests failed, first: {errors[0]}")
    outputs = np.concatenate([results[i] for i in range(len(requests))])
    return ServedRun(outputs, [latencies[i] for i in range(len(requests))], seconds)


def batch_request_stats(server, model: str) -> dict[str, float]:
    """Micro-batches the model ran and the mean requests / items each held."""
    from backend_lib.metrics import parse_prometheus_text

    samples = parse_prometheus_text(server.metrics_text())
    labels = frozenset({"model": model, "version": "1"}.items())
    count = samples.get(("encoder_batch_requests_count", labels), 0.0)
    total = samples.get(("encoder_batch_requests_sum", labels), 0.0)
    items = samples.get(("encoder_batch_size_sum", labels), 0.0)
    return {
        "micro_batches": count,
        "mean_requests_per_micro_batch": total / max(count, 1),
        "mean_items_per_micro_batch": items / max(count, 1),
    }


@dataclass
class Task:
    """One model's comparison: served requests against an in-process reference."""

    model: str
    output: str
    requests: list[dict[str, list[str]]]
    reference: Callable[[list[dict[str, list[str]]]], np.ndarray]
    check: Callable[[np.ndarray, np.ndarray], float]
    """(served, reference) -> agreement figure (min cosine, or max relative score error)."""
    passes: Callable[[float], bool]
    items: int
    tokens: int


def _items(request: dict[str, list[str]]) -> int:
    return len(next(iter(request.values())))


def compare(task: Task, url: str, clients: int, repeats: int) -> dict:
    """Check the first requests, then time served and reference passes alternately, checking
    every served pass against the reference outputs."""
    first = task.requests[: max(1, CHECK_ITEMS // _items(task.requests[0]))]
    figure = task.check(
        served_pass(url, task.model, task.output, first, clients).outputs, task.reference(first)
    )
    progress(
        f"{task.model}: fidelity figure on {sum(map(_items, first))} items before timing: "
        f"{figure:.7g}"
    )
    if not task.passes(figure):
        raise SystemExit(f"served {task.model} outputs differ from sentence-transformers: {figure}")
    served_runs: list[ServedRun] = []
    reference_outputs: list[np.ndarray] = []

    def served() -> None:
        served_runs.append(served_pass(url, task.model, task.output, task.requests, clients))

    timings = time_repeats(
        {
            "served": served,
            "sentence_transformers": lambda: reference_outputs.append(
                task.reference(task.requests)
            ),
        },
        repeats,
    )
    timed_figures = [task.check(run.outputs, reference_outputs[0]) for run in served_runs]
    if not all(map(task.passes, timed_figures)):
        raise SystemExit(f"a timed served {task.model} pass differs: {timed_figures}")
    latencies = [x for run in served_runs for x in run.latencies]
    ratios = [
        b / a
        for a, b in zip(
            timings["served"].seconds, timings["sentence_transformers"].seconds, strict=True
        )
    ]
    return {
        "items": task.items,
        "tokens": task.tokens,
        "requests": len(task.requests),
        "fidelity": {"before_timing": figure, "timed_passes": timed_figures, "passed": True},
        **rates(timings, task.items, task.tokens),
        "served_latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
        "served_vs_reference_per_repeat": ratios,
        "served_vs_reference": statistics.median(ratios),
    }


def write_repository(
    repository: Path, embedding_dir: Path, cross_encoder_dir: Path, dtype: str, device
) -> None:
    """A model repository holding the `embedding` and the `rerank` model."""
    from tooling.repository import ModelSpec, write_model

    models = {
        "embedding": {"model": str(embedding_dir), "dtype": dtype},
        "rerank": {"model": str(cross_encoder_dir), "mode": "cross_encoder", "dtype": dtype},
    }
    for name, parameters in models.items():
        write_model(
            ModelSpec(name, name, parameters, instance_kind=instance_kind(device)), repository
        )


def embedding_task(st, texts: list[str], request_size: int, gate: float) -> Task:
    """Texts in requests of `request_size`, against `SentenceTransformer.encode`."""
    # Tokens as the reference counts them (truncated to its max length).
    tokens = st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]
    return Task(
        "embedding",
        "embedding",
        [{"text_input": texts[i : i + request_size]} for i in range(0, len(texts), request_size)],
        lambda requests: st.encode([t for r in requests for t in r["text_input"]]),
        min_cosine,
        lambda cosine: cosine >= gate,
        len(texts),
        sum(map(len, tokens)),
    )


def rerank_task(ce, queries: list[str], documents: list[str], tolerance: float) -> Task:
    """One query with its documents a request, against `CrossEncoder.predict`."""
    tokens = ce.tokenizer(queries, documents, truncation=True, max_length=ce.max_seq_length)
    return Task(
        "rerank",
        "score",
        [
            {
                "query": queries[i : i + DOCUMENTS_PER_QUERY],
                "document": documents[i : i + DOCUMENTS_PER_QUERY],
            }
            for i in range(0, len(queries), DOCUMENTS_PER_QUERY)
        ],
        lambda requests: ce.predict(
            [(q, d) for r in requests for q, d in zip(r["query"], r["document"], strict=True)]
        ),
        lambda served, reference: max_score_error(served.reshape(-1), reference),
        lambda error: error <= tolerance,
        len(queries),
        sum(map(len, tokens["input_ids"])),
    )


def run(args: argparse.Namespace, scratch: Path) -> dict:
    cross_encoder_dir = build_cross_encoder(scratch / "cross_encoder", args.seed, HEAD_STD)
    return run_with(args, cross_encoder_dir, scratch / "repo")


def run_with(args: argparse.Namespace, cross_encoder_dir: Path, repository: Path) -> dict:
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from backend_lib.checkpoint import resolve_model_path

    device, dtype, dtype_name = cli.setup_torch(args)
    embedding_dir = resolve_model_path(DEFAULT_MODEL, Path.cwd())
    write_repository(repository, embedding_dir, cross_encoder_dir, dtype_name, device)
    texts = mixed_texts(args.texts, args.seed)
    queries, documents = rerank_pairs(args.pairs, args.seed)
    gate = args.min_cosine or cosine_gate(dtype)
    tolerance = score_tolerance(dtype)
    tasks = [
        embedding_task(
            reference_model(SentenceTransformer, embedding_dir, device, dtype),
            texts,
            args.request_size,
            gate,
        ),
        rerank_task(
            reference_model(CrossEncoder, cross_encoder_dir, device, dtype),
            queries,
            documents,
            tolerance,
        ),
    ]
    with tritonserver(repository, args.threads) as (server, server_start_s):
        results = {
            task.model: compare(task, server.http_url, args.clients, args.repeats) for task in tasks
        }
        for model in results:
            results[model]["server_batching"] = batch_request_stats(server, model)
    return {
        "device": str(device),
        "dtype": dtype_name,
        "models": {
            "embedding": "all-MiniLM-L6-v2",
            "rerank": "all-MiniLM-L6-v2 encoder + seeded random classification head "
            "(tooling.checkpoints.build_cross_encoder)",
        },
        "workload": {
            "texts": len(texts),
            "pairs": len(queries),
            "clients": args.clients,
            "embedding_request_size": args.request_size,
            "rerank_request_size": DOCUMENTS_PER_QUERY,
            "seed": args.seed,
        },
        "fidelity_gates": {"embedding_min_cosine": gate, "rerank_max_relative_error": tolerance},
        "repeats": args.repeats,
        "server_start_s": server_start_s,
        **results,
        "settings": {
            "torch_threads": torch.get_num_threads(),
            "server_threads": args.threads or "torch default (same as here)",
            "references": "SentenceTransformer.encode / CrossEncoder.predict defaults "
            "(batch_size=32), all inputs in one call",
        },
        "summary": {
            "embedding_served_vs_sentence_transformers": results["embedding"][
                "served_vs_reference"
            ],
            "rerank_served_vs_cross_encoder": results["rerank"]["served_vs_reference"],
        },
    }


def report(result: dict) -> list[str]:
    workload = result["workload"]
    lines = [
        f"{workload['clients']} HTTP client threads against tritonserver; embedding: "
        f"{workload['texts']} mixed-length texts in requests of {workload['embedding_request_size']};"
        f" rerank: {workload['pairs']} (query, document) pairs in requests of one query with "
        f"{workload['rerank_request_size']} documents (cross-encoder built from MiniLM with a "
        "seeded random head: no cross-encoder weights offline). Reference: sentence-transformers "
        f"in the client process, all inputs in one call. {result['dtype']} on {result['device']}, "
        f"{result['repeats']} interleaved repeats; outputs checked before and after timing "
        f"(gates: {result['fidelity_gates']}).",
        "",
        "| model | system | items/s median (min-max) | tokens/s median | request latency p50/p99 ms "
        "| requests per micro-batch |",
        "|---|---|---|---|---|---|",
    ]
    for model, reference in (("embedding", "SentenceTransformer"), ("rerank", "CrossEncoder")):
        m = result[model]
        for system, label in (("served", "tritonserver"), ("sentence_transformers", reference)):
            r = m["items_per_second"][system]
            latency = m["served_latency_s"] if system == "served" else None
            lines.append(
                f"| {model} | {label} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | "
                f"{m['tokens_per_second'][system]['median']:.0f} | "
                + (
                    f"{latency['p50'] * 1000:.0f} / {latency['p99'] * 1000:.0f} | "
                    f"{m['server_batching']['mean_requests_per_micro_batch']:.1f} |"
                    if latency
                    else "- | - |"
                )
            )
    summary = result["summary"]
    lines += [
        "",
        "No target for these (served overhead is the figure); served vs in-process: "
        f"embedding {summary['embedding_served_vs_sentence_transformers']:.2f}x, rerank "
        f"{summary['rerank_served_vs_cross_encoder']:.2f}x.",
        "",
    ]
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(
        texts=cli.ByMode(quick=16, cpu=128, cuda=4096),
        pairs=cli.ByMode(quick=16, cpu=96, cuda=4096),
    )
    parser.add_argument("--texts", type=int, help="embedding texts (default: %(default)s)")
    parser.add_argument("--pairs", type=int, help="rerank pairs (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--request-size", type=int, default=8, help="texts per embedding request")
    add_min_cosine_flag(parser)


# No plot: a few numbers, the table reads better.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
