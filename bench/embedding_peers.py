"""Embedding vs OpenVINO and ONNX Runtime on CPU, at 1 and 2 threads: `Embedder.encode` against
all-MiniLM-L6-v2 exported with optimum-intel (OpenVINO IR, fp32 weights) and to ONNX, same texts.

The peers run in a worker process of their own environment (`.venv-peers`, bench.peers): not our
process, but the same thread count (OpenVINO INFERENCE_NUM_THREADS, ONNX Runtime
intra_op_num_threads, OMP_NUM_THREADS), the same texts, tokenized there with the checkpoint's
tokenizer.json and embedded the sentence-transformers way (sorted by length, padded batches of
32, mean pooling, L2 normalization), timed by the worker, tokenization included as for ours.

Per precision (float32; bfloat16 only where the CPU has native bf16, OpenVINO only) and thread
count, every system embeds all texts once untimed; its embeddings must match ours (min cosine >=
0.9999 in float32, 0.99 in bfloat16) or it gets no figure; then all run interleaved `--repeats`
times. A summary figure (our items/s / the peer's, medians) is the worst thread count. In --quick
mode the peers are skipped (the report says why) unless --peers.

    python -m bench.embedding_peers [--quick] [--peers] [--texts 250] [--thread-counts 1,2]
                                    [--dtype auto] [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import cli
from bench.encoders import DEFAULT_MODEL, mixed_texts
from bench.encoders import min_cosine as cosine
from bench.output import progress
from bench.peers import plan
from bench.peers.client import PeerError, PeerWorker
from bench.skeleton import Benchmark
from bench.timing import spread, time_interleaved, timed

NAME = "embedding_peers"
HEADING = "Embedding vs OpenVINO and ONNX Runtime (CPU)"
DEFAULTS = cli.Defaults(plan.DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
CONVERSIONS = {"openvino": "openvino-encoder", "onnxruntime": "onnx-encoder"}
KEYS = {
    ("openvino", "float32"): "embedding_vs_openvino",
    ("openvino", "bfloat16"): "embedding_bf16_vs_openvino_bf16",
}
GATES = {"float32": 0.9999, "bfloat16": 0.99}
BATCH_SIZE = 32
"""The peers' batch size: sentence-transformers' default."""


def run(args: argparse.Namespace, _scratch: Path) -> dict[str, object]:
    from backend_lib.checkpoint import resolve_model_path

    device = cli.default_device(args.device)
    texts = mixed_texts(args.texts, args.seed)
    model_dir = resolve_model_path(args.model, Path.cwd())
    measured = plan.measure_all(
        args,
        device,
        model_dir,
        CONVERSIONS,
        KEYS,
        lambda threads, dtype, worker, paths: measure(
            args, model_dir, texts, threads, dtype, worker, paths
        ),
    )
    return {
        "model": args.model,
        "device": str(device),
        "texts": len(texts),
        "seed": args.seed,
        "repeats": args.repeats,
        **measured,
        "settings": {"peer_batch_size": BATCH_SIZE},
    }


def measure(args, model_dir: Path, texts, threads, dtype, worker, paths) -> dict:
    """One precision at one thread count: our embedder and each peer checked, then timed."""
    import torch

    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    torch.set_num_threads(threads)
    progress(f"{threads} thread(s), {dtype}")
    config = EmbeddingConfig(model=str(model_dir), dtype=dtype)
    embedder = Embedder.from_config(config, torch.device("cpu"), Path.cwd())
    reference = embedder.encode(texts)  # warm-up, and the embeddings every peer must give
    cpu: dict[str, list[float]] = {"embedder": []}
    systems = {"embedder": plan.cpu_metered(timed(lambda: embedder.encode(texts)), cpu["embedder"])}
    settings, cosines, excluded = {}, {}, {}
    peer_settings = {"max_seq_length": embedder.max_seq_length, "batch_size": BATCH_SIZE}
    for name, path in paths.items():
        if name == "onnxruntime" and dtype != "float32":
            excluded[name] = "float32 only (no bf16 CPU kernels)"
            continue
        try:
            settings[name] = worker.load(name, path, dtype, **peer_settings)
            embeddings, _ = worker.encode(name, texts)
        except PeerError as exc:
            excluded[name] = f"failed: {exc}"
            continue
        cosines[name] = cosine(reference, embeddings)
        progress(f"{name}: min cosine with ours {cosines[name]:.7f}")
        if cosines[name] < GATES[dtype]:
            excluded[name] = f"embeddings differ from ours (min cosine {cosines[name]:.5f})"
            continue
        cpu[name] = []
        systems[name] = plan.cpu_metered(_peer(worker, name), cpu[name], worker)
    seconds, _ = time_interleaved(systems, args.repeats)
    return {
        "threads": threads,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "items_per_second": {n: spread([len(texts) / t for t in s]) for n, s in seconds.items()},
        "ratio_vs_ours": plan.ratios(seconds, "embedder"),
        "cores_busy": plan.cores_busy(seconds, cpu),
        "min_cosine_with_ours": cosines,
        "gate": GATES[dtype],
        "excluded": excluded,
        "peer_settings": {**settings, "common": peer_settings},
    }


def _peer(worker: PeerWorker, name: str):
    return lambda: worker.encode(name, outputs=False)


def report(result: dict) -> list[str]:
    """Markdown section of the benchmark report."""
    lines = [
        f"{result['texts']} mixed-length texts, all-MiniLM-L6-v2, tokenization included, "
        f"{result['repeats']} interleaved repeat(s) per thread count. The peers run in a worker "
        "process of their own environment (.venv-peers: not the same process) with the same "
        "threads and texts: sorted by length, padded batches of "
        f"{result['settings']['peer_batch_size']}, mean pooling, normalized. Embeddings are "
        "checked against ours before timing.",
        "",
        "| threads | dtype | system | items/s median (min-max) | ours / system | cores busy | "
        "min cosine |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += plan.system_rows(
        result, "items_per_second", "min_cosine_with_ours", lambda cos: f"{cos:.7f}"
    )
    return [*lines, "", *plan.summary_lines(result)]


def add_args(parser: argparse.ArgumentParser) -> None:
    plan.add_args(parser)
    parser.set_defaults(texts=cli.ByMode(quick=16, cpu=250))
    parser.add_argument("--texts", type=int, help="how many texts (default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL)


# No plot: the table holds every thread count and dtype.
BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
