"""The embedding service on a SPLADE checkpoint: `indices` / `values` padded per request, equal to
SparseEncoder's vectors; a bad request (an over-long text without truncation, an unknown prompt, a
dense-only input) fails alone while the others of its `execute` are answered; the Triton config
must declare the outputs the mode computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.contract import INDICES, NUM_INPUT_TOKENS, VALUES
from backend_lib.encoder.service import EmbeddingService, SparseEmbeddingService
from backend_lib.errors import InputError
from backend_lib.model_context import ModelContext
from tests.encoder.sparse_helpers import (
    MAX_SEQ_LENGTH,
    assert_same_vectors,
    reference_vectors,
    sparse_embedder,
)
from tooling.repository import ModelSpec, read_config, render_config

LONG = "a long sentence that goes on and on " * 20  # > 32 tokens
TEXTS = ["what smells sweet?", "the rose smells sweet", "x", LONG]


def _request(texts, **extra) -> dict:
    return {"text_input": np.array([[t.encode()] for t in texts], dtype=object), **extra}


def _rows(result: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each row's ids and weights with the padding dropped, after checking the padding."""
    indices, values = result[INDICES], result[VALUES]
    assert indices.dtype == np.int64 and values.dtype == np.float32
    assert indices.shape == values.shape and indices.shape[0] == len(result[NUM_INPUT_TOKENS])
    kept = indices >= 0
    assert (values[~kept] == 0).all() and kept.sum(axis=1).max() == indices.shape[1]
    return [r[k] for r, k in zip(indices, kept, strict=True)], [
        v[k] for v, k in zip(values, kept, strict=True)
    ]


@pytest.fixture(scope="module")
def service(splade_dir) -> SparseEmbeddingService:
    return SparseEmbeddingService(sparse_embedder(splade_dir))


def test_outputs_are_padded_rows_of_sparse_encoders_vectors(service, splade_dir):
    first, second = service.execute([_request(TEXTS[:3]), _request(TEXTS[3:])])
    assert set(first) == {INDICES, VALUES, NUM_INPUT_TOKENS}
    ids, weights = _rows(first)
    more_ids, more_weights = _rows(second)
    assert_same_vectors(
        ids + more_ids, weights + more_weights, reference_vectors(splade_dir, TEXTS)
    )
    counts = [*first[NUM_INPUT_TOKENS][:, 0], *second[NUM_INPUT_TOKENS][:, 0]]
    assert counts[-1] == MAX_SEQ_LENGTH and counts[2] == 3  # [CLS] x [SEP]
    (query,) = service.execute([_request(TEXTS, prompt_name=np.array([[b"query"]] * 4))])
    ids, weights = _rows(query)
    assert_same_vectors(ids, weights, reference_vectors(splade_dir, TEXTS, prompt_name="query"))


def test_token_id_items_embed_like_their_texts(service):
    ids = service.embedder.tokenize(TEXTS[:2])
    from_text, *from_ids = service.execute(
        [_request(TEXTS[:2])] + [{"input_ids": np.array([row], dtype=np.int64)} for row in ids]
    )
    for row, result in enumerate(from_ids):
        np.testing.assert_array_equal(_rows(result)[0][0], _rows(from_text)[0][row])


@pytest.mark.parametrize(
    "bad,message",
    [
        (_request([LONG], truncate=np.array([[False]])), f"over the limit of {MAX_SEQ_LENGTH}"),
        (_request(["x"], prompt_name=np.array([[b"passage"]])), "'document', 'query'"),
        (_request(["x"], dimensions=np.array([[16]], dtype=np.int32)), "'dimensions' does not"),
        (_request(["x"], normalize=np.array([[True]])), "'normalize' does not apply"),
        ({"input_ids": np.array([[101, 30522, 102]])}, "outside the vocabulary"),
        ({}, "send exactly one of"),
    ],
)
def test_a_bad_request_fails_alone(service, splade_dir, bad, message):
    good = _request(TEXTS)
    before, failed, after = service.execute([good, bad, good])
    assert isinstance(failed, InputError) and message in str(failed)
    expected = reference_vectors(splade_dir, TEXTS)
    for result in (before, after):
        assert_same_vectors(*_rows(result), expected)


def _context(splade_dir, spec_parameters: dict[str, str], parameters=None) -> ModelContext:
    """The context Triton gives a model rendered from `spec_parameters` (its config.pbtxt)."""
    config = read_config(render_config(ModelSpec("m", "embedding", spec_parameters)))
    parameters = {"model": str(splade_dir), "dtype": "float32", **(parameters or {})}
    return ModelContext("m", "1", splade_dir, torch.device("cpu"), parameters, config)


def test_the_mode_picks_the_service_and_must_match_the_config(splade_dir):
    sparse = _context(splade_dir, {"mode": "sparse"})
    assert isinstance(EmbeddingService.from_context(sparse, None), SparseEmbeddingService)
    # auto on a SPLADE checkpoint is sparse; a dense config.pbtxt cannot carry its outputs.
    with pytest.raises(ConfigError, match="'indices' and 'values'") as info:
        EmbeddingService.from_context(_context(splade_dir, {}), None)
    assert info.value.key == "mode"
    with pytest.raises(ConfigError, match="'embedding'") as info:
        EmbeddingService.from_context(
            _context(splade_dir, {"mode": "sparse"}, {"mode": "dense"}), None
        )
    assert info.value.key == "mode"
