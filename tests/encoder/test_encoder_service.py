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


def _ids(*texts: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), local_files_only=True)
    return tokenizer(list(texts)).input_ids


def test_token_id_items_embed_exactly_like_their_texts(minilm):
    service = EmbeddingService(minilm)
    texts = ["To be, or not to be", "a rose"]
    ids = _ids(*texts)
    from_text, *from_ids = service.execute(
        [{"text_input": _column(*texts)}]
        + [{"input_ids": np.array([row], dtype=np.int64)} for row in ids]
    )
    np.testing.assert_array_equal(
        np.concatenate([r[EMBEDDING] for r in from_ids]), from_text[EMBEDDING]
    )
    assert [int(r[NUM_INPUT_TOKENS][0, 0]) for r in from_ids] == [len(row) for row in ids]


def test_bad_token_id_items_fail_alone(minilm):
    service = EmbeddingService(minilm)
    vocab = minilm.encoder.arch.vocab_size
    good = {"input_ids": np.array(_ids("hello world"), dtype=np.int64)}
    bad = {
        f"token id {vocab} is outside": {"input_ids": np.array([[101, vocab, 102]])},
        "token id -1 is outside": {"input_ids": np.array([[101, -1, 102]], dtype=np.int64)},
        "expected 1..256": {"input_ids": np.full((1, 257), 1000, dtype=np.int64)},
        "exactly one of": {"input_ids": good["input_ids"], "text_input": _column("x")},
        "integer type": {"input_ids": np.array([[1.5, 2.0]])},
    }
    results = service.execute([good, *bad.values(), good])
    assert isinstance(results[0], dict) and isinstance(results[-1], dict)
    np.testing.assert_array_equal(results[0][EMBEDDING], results[-1][EMBEDDING])
    for expected, result in zip(bad, results[1:-1], strict=True):
        assert isinstance(result, InputError) and expected in str(result), (expected, result)
    assert "exactly one of" in str(service.execute([{"normalize": np.array([[True]])}])[0])
