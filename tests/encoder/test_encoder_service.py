"""The encoder services' responses: the computed output and `num_input_tokens`, the tokens each row
was computed on after truncation (what the frontend reports as usage)."""

from __future__ import annotations

import numpy as np
from transformers import AutoTokenizer

from backend_lib.contract import EMBEDDING, NUM_INPUT_TOKENS, SCORE
from backend_lib.encoder.reranker import BiEncoderReranker
from backend_lib.encoder.service import EmbeddingService, RerankService
from backend_lib.errors import InputError
from tooling.checkpoints import MINILM_DIR

LONG = "a long sentence that goes on and on and on " * 100  # > 256 tokens


def _column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=object)


def _truncated_counts(texts: list[str], max_length: int) -> list[int]:
    """The real tokenizer's token counts, truncated to `max_length` (sentence-transformers')."""
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), local_files_only=True)
    return [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length).input_ids]


def test_embedding_reports_the_tokens_it_embedded(minilm):
    service = EmbeddingService(minilm)
    texts = [LONG, "short", "hello world"]
    bad = {"text_input": _column("x"), "truncate": np.array([[False]])}
    long_refused = {"text_input": _column(LONG), "truncate": np.array([[False]])}
    first, second, refused = service.execute(
        [{"text_input": _column(*texts[:2])}, {"text_input": _column(texts[2])}, long_refused]
    )
    assert set(first) == {EMBEDDING, NUM_INPUT_TOKENS}
    assert first[EMBEDDING].shape == (2, minilm.dim)
    assert first[NUM_INPUT_TOKENS].dtype == np.uint32 and first[NUM_INPUT_TOKENS].shape == (2, 1)
    counts = [*first[NUM_INPUT_TOKENS][:, 0], *second[NUM_INPUT_TOKENS][:, 0]]
    assert counts == _truncated_counts(texts, minilm.max_seq_length)
    assert counts[0] == minilm.max_seq_length == 256  # cut, as it was embedded
    assert isinstance(refused, InputError)
    assert isinstance(service.execute([bad])[0], dict)  # one short text without truncation: fine


def test_rerank_reports_each_pairs_tokens(minilm):
    service = RerankService(BiEncoderReranker(minilm))
    (result,) = service.execute([{"query": _column("q", "q"), "document": _column(LONG, "doc")}])
    assert result[SCORE].shape == (2, 1) and result[NUM_INPUT_TOKENS].shape == (2, 1)
    query, long_doc, doc = _truncated_counts(["q", LONG, "doc"], minilm.max_seq_length)
    assert result[NUM_INPUT_TOKENS][:, 0].tolist() == [query + long_doc, query + doc]
