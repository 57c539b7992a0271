"""Instruction prompts and Matryoshka `dimensions` of the embedding service, against
sentence-transformers' `encode(prompt_name=...)` and `truncate_dim` on MiniLM checkpoints that
declare prompts (config_sentence_transformers.json) and matryoshka_dimensions (config.json)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_lib.contract import EMBEDDING
from backend_lib.encoder.service import EmbeddingService
from backend_lib.errors import InputError
from tests.encoder.encoder_helpers import prompt_checkpoint

TEXTS = ["what smells sweet?", "the rose smells sweet", "Ünïcödé: café, 東京タワー", "x"]


def _st(path, **kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True, **kwargs)


def _service(path) -> EmbeddingService:
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    config = EmbeddingConfig(model=str(path), dtype="float32")
    return EmbeddingService(Embedder.from_config(config, torch.device("cpu"), path))


def _request(texts, prompt_name=None, dimensions=None, **extra) -> dict:
    inputs = {"text_input": np.array([[t.encode()] for t in texts], dtype=object), **extra}
    if prompt_name is not None:
        inputs["prompt_name"] = np.array([[prompt_name.encode()]] * len(texts), dtype=object)
    if dimensions is not None:
        inputs["dimensions"] = np.full((len(texts), 1), dimensions, dtype=np.int32)
    return inputs


def _assert_close(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    cosine = (ours * reference).sum(-1) / (
        np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1)
    )
    assert cosine.min() >= 0.99999, cosine


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    return prompt_checkpoint(tmp_path_factory.mktemp("prompted"))


@pytest.fixture(scope="module")
def prompted_service(prompted):
    return _service(prompted)


def test_prompt_names_embed_as_sentence_transformers(prompted, prompted_service):
    reference = _st(prompted)
    results = prompted_service.execute(
        [_request(TEXTS, name) for name in ("query", "document")] + [_request(TEXTS)]
    )
    for name, result in zip(("query", "document", None), results, strict=True):
        _assert_close(result[EMBEDDING], reference.encode(TEXTS, prompt_name=name))
    # The prompt changes the vector: "query: " differs from no prompt.
    assert not np.allclose(results[0][EMBEDDING], results[2][EMBEDDING], atol=1e-3)


@pytest.mark.parametrize("dimensions", [64, 128, 256, 384])
def test_dimensions_equal_truncate_dim_then_normalised(prompted, prompted_service, dimensions):
    reference = _st(prompted, truncate_dim=dimensions).encode(
        TEXTS, prompt_name="query", normalize_embeddings=True
    )
    (result,) = prompted_service.execute([_request(TEXTS, "query", dimensions)])
    assert result[EMBEDDING].shape == (len(TEXTS), dimensions)
    _assert_close(result[EMBEDDING], reference)
    np.testing.assert_allclose(np.linalg.norm(result[EMBEDDING], axis=1), 1, atol=1e-5)


def test_dimensions_without_normalize_are_the_first_components(prompted_service):
    full, cut = prompted_service.execute(
        [
            _request(TEXTS, normalize=np.array([[False]])),
            _request(TEXTS, dimensions=64, normalize=np.array([[False]])),
        ]
    )
    np.testing.assert_allclose(cut[EMBEDDING], full[EMBEDDING][:, :64], atol=1e-6)


def test_default_prompt_name_applies_when_none_is_named(tmp_path):
    path = prompt_checkpoint(tmp_path, default_prompt_name="query")
    reference = _st(path)
    default, named_none = _service(path).execute([_request(TEXTS), _request(TEXTS, "document")])
    _assert_close(default[EMBEDDING], reference.encode(TEXTS))  # ST applies the default too
    _assert_close(default[EMBEDDING], reference.encode(TEXTS, prompt_name="query"))
    _assert_close(named_none[EMBEDDING], reference.encode(TEXTS, prompt_name="document"))


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "weightedmean", "lasttoken"])
def test_include_prompt_false_pools_without_the_prompt(tmp_path, mode):
    path = prompt_checkpoint(tmp_path, include_prompt=False, pooling_mode=mode)
    reference = _st(path)
    query, plain = _service(path).execute([_request(TEXTS, "query"), _request(TEXTS)])
    _assert_close(query[EMBEDDING], reference.encode(TEXTS, prompt_name="query"))
    _assert_close(plain[EMBEDDING], reference.encode(TEXTS))


def test_bad_prompt_and_dimensions_fail_alone_in_a_mixed_batch(prompted, prompted_service):
    reference = _st(prompted)
    good, unknown, bad_size, good_cut = prompted_service.execute(
        [
            _request(TEXTS, "query"),
            _request(TEXTS, "passage"),
            _request(TEXTS, dimensions=100),
            _request(TEXTS[:2], "document", 128),
        ]
    )
    assert isinstance(unknown, InputError) and isinstance(bad_size, InputError)
    assert "'prompt_name' 'passage'" in str(unknown) and "'query', 'document'" in str(unknown)
    assert "'dimensions' 100" in str(bad_size) and "64, 128, 256, 384" in str(bad_size)
    _assert_close(good[EMBEDDING], reference.encode(TEXTS, prompt_name="query"))
    cut = _st(prompted, truncate_dim=128).encode(
        TEXTS[:2], prompt_name="document", normalize_embeddings=True
    )
    _assert_close(good_cut[EMBEDDING], cut)


def test_a_model_without_prompts_or_matryoshka_sizes_says_so(minilm):
    service = EmbeddingService(minilm)
    no_prompt, cut, full = service.execute(
        [_request(["a"], "query"), _request(["a"], dimensions=64), _request(["a"], dimensions=384)]
    )
    assert "this model has no prompts" in str(no_prompt)
    assert "'dimensions' 64" in str(cut) and "sizes: 384" in str(cut)
    assert full[EMBEDDING].shape == (1, 384)


def test_request_values_must_be_shared_and_prompts_need_texts(prompted_service):
    mixed = _request(["a", "b"], dimensions=64)
    mixed["dimensions"] = np.array([[64], [128]], dtype=np.int32)
    ids = {"input_ids": np.array([[101, 102]]), "prompt_name": np.array([[b"query"]], dtype=object)}
    shared, on_ids = prompted_service.execute([mixed, ids])
    assert "one value shared by all 2 rows" in str(shared)
    assert "'prompt_name' applies to 'text_input' only" in str(on_ids)
