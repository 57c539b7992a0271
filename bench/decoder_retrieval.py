"""Decoder retrieval models: a Qwen3 last-token embedder against `SentenceTransformer.encode`, and
two Qwen3 rerankers against `CrossEncoder.predict`: a `ForSequenceClassification` one and the
causal-LM form (chat template, yes/no logits at the last token); same texts, same threads, in one
process (all on the LLM engine's forward, backend_lib/encoder/packed_decoder.py).

No decoder embedder or reranker weights are available offline, so the checkpoints are built in
a temp dir with random weights (tooling.checkpoints) on the Shakespeare tokenizer, which appends
an end token as Qwen3-Embedding's does. Speed does not depend on what
the weights learned; outputs are still checked equal (cosine, scores) before anything is timed,
then each pair of systems is timed alternately (bench.embedding, bench.rerank).

    python -m bench.decoder_retrieval [--quick] [--texts 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import cli, embedding, rerank
from bench.encoders import rate_rows
from bench.skeleton import Benchmark
from bench.summary import target
from tooling.checkpoints import build_causal_reranker, build_decoder_body, write_st_files

NAME = "decoder_retrieval"
HEADING = "Decoder embedder and reranker vs sentence-transformers"
DEFAULTS = cli.Defaults(cli.DEFAULT_DTYPE, threads=0, repeats=cli.ByMode(quick=1, cpu=3))
EMBED_KEY, RERANK_KEY = "decoder_embedding_vs_sentence_transformers", "llm_rerank_vs_cross_encoder"
CAUSAL_KEY = "causal_llm_rerank_vs_cross_encoder"
BODY = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)
"""The timed body (CPU mode): Qwen3, ~30M parameters, 8 layers of 512; quick mode uses the tiny
test shape."""
MAX_SEQ_LENGTH = 512


def run(args: argparse.Namespace, scratch: Path) -> dict:
    shape = {"max_position_embeddings": 1024} if args.quick else BODY
    described = ", ".join(f"{k}={v}" for k, v in shape.items())
    embedder = build_decoder_body("Qwen3ForCausalLM", scratch / "embedder", args.seed, **shape)
    write_st_files(embedder, "lasttoken", normalize=True, max_seq_length=MAX_SEQ_LENGTH)
    reranker = build_decoder_body(
        "Qwen3ForCausalLM", scratch / "reranker", args.seed, num_labels=1, **shape
    )
    causal = build_causal_reranker(scratch / "causal", seed=args.seed, **shape)
    embed_model = f"random Qwen3Model ({described}), last-token pooling, normalized"
    rerank_model = f"random Qwen3ForSequenceClassification ({described}), one label"
    causal_model = f"random Qwen3ForCausalLM ({described}), chat template, LogitScore(Yes, No)"
    embed_args = argparse.Namespace(**{**vars(args), "min_cosine": None})
    rerank_args = argparse.Namespace(
        **{**vars(args), "texts": max(8, args.texts // 4), "tolerance": None}
    )
    embedded = embedding.run_with(embed_args, embedder, embed_model, EMBED_KEY)
    reranked = rerank.run_with(rerank_args, reranker, rerank_model, RERANK_KEY)
    causal_reranked = rerank.run_with(rerank_args, causal, causal_model, CAUSAL_KEY)
    return {
        "device": embedded["device"],
        "dtype": embedded["dtype"],
        "fidelity": {
            "embedding": embedded["fidelity"],
            "rerank": reranked["fidelity"],
            "causal_rerank": causal_reranked["fidelity"],
        },
        "embedding": embedded,
        "rerank": reranked,
        "causal_rerank": causal_reranked,
        "summary": {**embedded["summary"], **reranked["summary"], **causal_reranked["summary"]},
    }


def report(result: dict) -> list[str]:
    lines = []
    for part, key, bar, systems in (
        (
            "embedding",
            EMBED_KEY,
            "SentenceTransformer.encode",
            ("sentence_transformers", "embedder"),
        ),
        ("rerank", RERANK_KEY, "CrossEncoder.predict", ("cross_encoder", "reranker")),
        ("causal_rerank", CAUSAL_KEY, "CrossEncoder.predict", ("cross_encoder", "reranker")),
    ):
        section = result[part]
        ratio, goal = section["summary"][key], target(key)
        met = "met" if ratio >= goal else "NOT met"
        lines += [
            f"{part}: {section['model']}, {section['dtype']} on {section['device']}, "
            f"{section['repeats']} interleaved repeats, tokenization included.",
            "",
            *rate_rows(section, systems),
            "",
            f"Target `{key}`: >= {goal}x {bar}: {ratio:.2f}x ({met}).",
            "",
        ]
    return lines


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(texts=cli.ByMode(quick=16, cpu=400))
    parser.add_argument("--texts", type=int, help="texts to embed (pairs: a quarter)")


BENCHMARK = Benchmark(NAME, HEADING, __doc__, DEFAULTS, run, report, add_args=add_args)

if __name__ == "__main__":
    BENCHMARK.main()
