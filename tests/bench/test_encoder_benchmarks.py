"""The direct embedding and rerank benchmarks in the quick suite: their output checks passed and
their rates follow from their timings."""

from __future__ import annotations

import math

import pytest

from tests.bench.checks import quick_result

pytestmark = pytest.mark.bench


def test_embedding(quick_suite):
    result = quick_result(
        quick_suite, "embedding", {"embedding_vs_sentence_transformers"}, 0, against_target=True
    )
    assert result["fidelity"]["min_cosine"] >= result["fidelity"]["gate"]
    tokens = result["tokens"]["total"]
    for name, seconds in result["seconds"].items():
        assert result["tokens_per_second"][name]["median"] == pytest.approx(tokens / seconds[0])


def test_rerank(quick_suite):
    result = quick_result(
        quick_suite, "rerank", {"rerank_vs_cross_encoder"}, 0, against_target=True
    )
    fidelity = result["fidelity"]
    assert fidelity["max_relative_score_error"] <= fidelity["tolerance"]
    assert fidelity["logit_span"] > 0.1  # the seeded head separates the pairs
    items = result["workload"]["pairs"]
    for name, seconds in result["seconds"].items():
        assert result["items_per_second"][name]["median"] == pytest.approx(items / seconds[0])
    assert all(math.isfinite(r) for r in result["ratio_per_repeat"])


def test_decoder_retrieval(quick_suite):
    keys = {
        "decoder_embedding_vs_sentence_transformers",
        "llm_rerank_vs_cross_encoder",
        "causal_llm_rerank_vs_cross_encoder",
    }
    result = quick_result(quick_suite, "decoder_retrieval", keys, 0, against_target=True)
    embedded = result["embedding"]
    assert embedded["fidelity"]["min_cosine"] >= embedded["fidelity"]["gate"]
    for part in ("rerank", "causal_rerank"):
        fidelity = result[part]["fidelity"]
        assert fidelity["max_relative_score_error"] <= fidelity["tolerance"]
    assert result["summary"].keys() == keys
