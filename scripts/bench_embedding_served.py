#!/usr/bin/env python3
"""Embedding throughput through tritonserver with concurrent clients vs `SentenceTransformer.encode`.

Starts a real tritonserver on a repository holding only the `embedding` model, sends the same mixed-length
texts as scripts/bench_embedding.py from N concurrent HTTP clients (requests of --request-size texts),
checks every embedding against sentence-transformers, then reports items/s of both and their ratio.

    python scripts/bench_embedding_served.py --texts 2000 --clients 16 --out bench/results/embedding_served.json
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embedding import DEFAULT_MODEL, machine_info, min_cosine, mixed_texts  # noqa: E402

from backend_lib.checkpoint import resolve_model_path  # noqa: E402
from backend_lib.metrics import parse_prometheus_text  # noqa: E402
from backend_lib.model_repository import ModelSpec, write_model  # noqa: E402
from backend_lib.server_harness import TritonServer  # noqa: E402


def served_embeddings(server: TritonServer, texts: list[str], clients: int,
                      request_size: int) -> tuple[np.ndarray, float]:
    """Embed `texts` through the server from `clients` threads; (embeddings, seconds)."""
    chunks: queue.Queue = queue.Queue()
    for start in range(0, len(texts), request_size):
        chunks.put(start)
    rows: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def client_loop() -> None:
        client = httpclient.InferenceServerClient(server.http_url, connection_timeout=300,
                                                  network_timeout=300)
        while True:
            try:
                start = chunks.get_nowait()
            except queue.Empty:
                return
            batch = np.array([t.encode() for t in texts[start:start + request_size]],
                             dtype=object).reshape(-1, 1)
            tensor = httpclient.InferInput("text_input", list(batch.shape), "BYTES")
            tensor.set_data_from_numpy(batch)
            try:
                rows[start] = client.infer("embedding", [tensor]).as_numpy("embedding")
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)
                return

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return np.concatenate([rows[start] for start in sorted(rows)]), seconds


def batch_request_stats(server: TritonServer) -> dict[str, float]:
    samples = parse_prometheus_text(server.metrics_text())
    labels = frozenset({"model": "embedding", "version": "1"}.items())
    count = samples.get(("encoder_batch_requests_count", labels), 0.0)
    total = samples.get(("encoder_batch_requests_sum", labels), 0.0)
    items = samples.get(("encoder_batch_size_sum", labels), 0.0)
    return {"micro_batches": count, "mean_requests_per_micro_batch": total / max(count, 1),
            "mean_items_per_micro_batch": items / max(count, 1)}


def run(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    texts = mixed_texts(args.texts, args.seed)
    reference_model = SentenceTransformer(str(resolve_model_path(DEFAULT_MODEL, Path("."))),
                                          device="cpu")
    with tempfile.TemporaryDirectory() as repo:
        write_model(ModelSpec("embedding", "embedding", {"model": DEFAULT_MODEL}), Path(repo))
        with TritonServer(repo) as server:
            served_embeddings(server, texts[:64], args.clients, args.request_size)  # warm-up
            timings = {"served": [], "sentence_transformers": []}
            for _ in range(args.repeats):
                served, seconds = served_embeddings(server, texts, args.clients, args.request_size)
                timings["served"].append(seconds)
                started = time.perf_counter()
                reference = reference_model.encode(texts)
                timings["sentence_transformers"].append(time.perf_counter() - started)
            stats = batch_request_stats(server)
    cosine = min_cosine(served, reference)
    if cosine < 0.9999:
        raise AssertionError(f"served embeddings differ from sentence-transformers: {cosine}")
    rates = {name: sorted(args.texts / s for s in values) for name, values in timings.items()}
    medians = {name: float(np.median(values)) for name, values in rates.items()}
    return {
        "benchmark": "embedding_served",
        "texts": args.texts, "clients": args.clients, "request_size": args.request_size,
        "repeats": args.repeats, "min_cosine": cosine, "seconds": timings,
        "items_per_second": {name: {"min": v[0], "median": float(np.median(v)), "max": v[-1]}
                             for name, v in rates.items()},
        "ratio_served_vs_sentence_transformers": medians["served"] / medians["sentence_transformers"],
        "server_batching": stats,
        "machine": machine_info(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--request-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/embedding_served.json"))
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("items_per_second",
                                               "ratio_served_vs_sentence_transformers",
                                               "server_batching")}, indent=2))


if __name__ == "__main__":
    main()
