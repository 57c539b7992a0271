"""SPLADE test helpers: sentence-transformers' SparseEncoder as the reference, our SparseEmbedder on
the same checkpoint, the comparison both tests and the e2e test make, and an XLM-R SPLADE."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tests.encoder.encoder_helpers import build_xlmr_tokenizer
from tooling.checkpoints import build_splade, tiny_bert_config

PROMPTS = {"query": "query: ", "document": "passage: "}
MAX_SEQ_LENGTH = 32
"""The test checkpoints' max_seq_length: the long texts of `enc.texts` are cut there."""


def sparse_encoder(path: Path, **kwargs):
    """sentence-transformers' SparseEncoder on `path`, the reference."""
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(path), device="cpu", local_files_only=True, **kwargs)


def reference_vectors(path: Path, texts: Sequence[str], **encode_kwargs) -> np.ndarray:
    """[N, vocab] float32 dense vectors of `SparseEncoder.encode` (`encode_kwargs`: prompt_name)."""
    encoded = sparse_encoder(path).encode(
        list(texts), convert_to_sparse_tensor=False, **encode_kwargs
    )
    return encoded.numpy()


def sparse_embedder(path: Path, **settings):
    """Our SparseEmbedder on `path`, float32 on CPU (`settings`: more EmbeddingConfig fields)."""
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.sparse import SparseEmbedder

    config = EmbeddingConfig(model=str(path), dtype="float32", mode="sparse", **settings)
    return SparseEmbedder.from_config(config, torch.device("cpu"), Path("."))


def assert_same_vectors(
    indices: Sequence[np.ndarray], values: Sequence[np.ndarray], reference: np.ndarray
) -> None:
    """Each row's ids are the reference row's nonzero ids, ascending, int64; its float32 weights
    are within 1e-4 of the reference's."""
    assert len(indices) == len(values) == len(reference)
    for row, (ids, weights, expected) in enumerate(zip(indices, values, reference, strict=True)):
        nonzero = np.flatnonzero(expected)
        assert ids.dtype == np.int64 and weights.dtype == np.float32, row
        np.testing.assert_array_equal(ids, nonzero, err_msg=f"row {row}")
        np.testing.assert_allclose(weights, expected[nonzero], rtol=0, atol=1e-4, err_msg=f"{row}")


def assert_realistic(reference: np.ndarray) -> None:
    """The vectors compared are sparse (under 5% of the vocabulary) and differ from text to text,
    so equal ids mean something."""
    counts = (reference > 0).sum(axis=1)
    assert counts.max() < 0.05 * reference.shape[1] and counts.min() > 0, counts
    assert len({tuple(np.flatnonzero(row)) for row in reference}) == len(reference)


def build_xlmr_splade(target: Path, **kwargs) -> Path:
    """A random XLMRobertaForMaskedLM SPLADE (`build_splade`'s `kwargs`) under an XLM-R style
    tokenizer (<s> ... </s>, pad id 1), its positions after padding_idx as RoBERTa's are."""
    from transformers import XLMRobertaConfig

    tokenizer_dir = target / "tokenizer"
    tokenizer_dir.mkdir(parents=True)
    vocab_size = build_xlmr_tokenizer(tokenizer_dir, lowercase=False, model_max_length=128)
    config = XLMRobertaConfig(
        **tiny_bert_config(vocab_size=vocab_size, max_position_embeddings=130).to_dict()
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 1, 0, 2
    config.type_vocab_size, config.architectures = 1, ["XLMRobertaForMaskedLM"]
    return build_splade(target / "model", config, tokenizer_dir=tokenizer_dir, **kwargs)
