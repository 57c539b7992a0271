"""SPLADE sparse embeddings against sentence-transformers' `SparseEncoder.encode` on random-weight
`*ForMaskedLM` checkpoints it saved itself: the same nonzero vocabulary ids, weights within 1e-4
(float32), for max and sum pooling, BERT and XLM-R heads, both module forms, prompts, truncation at
max_seq_length, micro-batches and head chunks that split the texts; bad settings name their field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError, from_parameters
from backend_lib.encoder import sparse
from backend_lib.encoder.config import EmbeddingConfig
from backend_lib.encoder.sparse import SparseEmbedder, serves_sparse
from backend_lib.errors import InputError
from tests.encoder.sparse_helpers import (
    MAX_SEQ_LENGTH,
    PROMPTS,
    assert_realistic,
    assert_same_vectors,
    build_xlmr_splade,
    reference_vectors,
    sparse_embedder,
    sparse_encoder,
)
from tooling.checkpoints import build_splade

CPU = torch.device("cpu")


def assert_encodes_as_reference(embedder, path: Path, texts, **kwargs) -> np.ndarray:
    """Our vectors of `texts` equal SparseEncoder's (`kwargs`: prompt_name, truncate for ours);
    returns the reference's."""
    prompt_name = kwargs.get("prompt_name")
    reference = reference_vectors(path, texts, prompt_name=prompt_name)
    vectors = embedder.encode(texts, **kwargs)
    assert_same_vectors([v.indices for v in vectors], [v.values for v in vectors], reference)
    return reference


VARIANTS = {
    "bert_max": dict(),
    "bert_sum": dict(pooling_strategy="sum"),
    # sentence-transformers 6's own form: a Transformer with transformer_task fill-mask.
    "bert_transformer_log1p_relu": dict(
        transformer_module="Transformer", activation_function="log1p_relu"
    ),
}


@pytest.mark.parametrize("variant", [*VARIANTS, "xlmr_max", "xlmr_sum"])
def test_vectors_match_sparse_encoder(variant, tmp_path, enc):
    if variant.startswith("xlmr"):
        strategy = variant.removeprefix("xlmr_")
        path = build_xlmr_splade(
            tmp_path, seed=1, pooling_strategy=strategy, max_seq_length=MAX_SEQ_LENGTH
        )
    else:
        path = build_splade(tmp_path, seed=2, max_seq_length=MAX_SEQ_LENGTH, **VARIANTS[variant])
    embedder = sparse_embedder(path)
    assert embedder.max_seq_length == sparse_encoder(path).max_seq_length == MAX_SEQ_LENGTH
    reference = assert_encodes_as_reference(embedder, path, enc.texts)
    assert_realistic(reference)


def test_batches_and_head_chunks_that_split_texts(splade_dir, enc, monkeypatch):
    """Many micro-batches of mixed lengths, and head chunks of 7 rows, which cut texts apart
    (the max / sum over a text spans chunks)."""
    monkeypatch.setattr(sparse, "HEAD_CHUNK_TOKENS", 7)
    embedder = sparse_embedder(splade_dir, max_batch_tokens=64, max_batch_size=3)
    texts = [*enc.texts, *(f"word {i} " * i for i in range(1, 12))]
    tokens = embedder.tokenize(texts)
    vectors, batches = embedder.embed(tokens)
    assert len(batches) > 5 and sorted(i for b in batches for i in b.indices) == list(
        range(len(texts))
    )
    reference = reference_vectors(splade_dir, texts)
    assert_same_vectors([v.indices for v in vectors], [v.values for v in vectors], reference)


def test_truncation_at_max_seq_length(splade_dir):
    long = "the quick brown fox jumps over the lazy dog " * 10
    embedder = sparse_embedder(splade_dir)
    (ids,) = embedder.tokenize([long])
    assert len(ids) == MAX_SEQ_LENGTH
    assert_encodes_as_reference(embedder, splade_dir, [long, "short"], truncate=True)
    with pytest.raises(InputError, match=f"over the limit of {MAX_SEQ_LENGTH}"):
        embedder.encode([long], truncate=False)
    # A configured max_seq_length, as SparseEncoder's own setting.
    shorter = sparse_embedder(splade_dir, max_seq_length=12)
    reference = sparse_encoder(splade_dir)
    reference.max_seq_length = 12
    expected = reference.encode([long], convert_to_sparse_tensor=False).numpy()
    (vector,) = shorter.encode([long])
    assert_same_vectors([vector.indices], [vector.values], expected)


def test_prompts_as_encode_prompt_name(tmp_path, enc):
    path = build_splade(
        tmp_path, max_seq_length=MAX_SEQ_LENGTH, prompts=PROMPTS, default_prompt_name="query"
    )
    embedder = sparse_embedder(path)
    texts = enc.texts[:4]
    for name in ("query", "document", None):  # None: the default prompt, "query"
        assert_encodes_as_reference(embedder, path, texts, prompt_name=name)
    assert embedder.resolve_prompt(None) == PROMPTS["query"]
    with pytest.raises(InputError, match="'document', 'query'"):
        embedder.encode(texts, prompt_name="passage")


def test_max_active_dims_keeps_the_largest_weights(splade_dir, tmp_path, enc):
    path = tmp_path / "model"
    shutil.copytree(splade_dir, path)
    st_file = path / "config_sentence_transformers.json"
    st_config = json.loads(st_file.read_text())
    st_file.write_text(json.dumps({**st_config, "max_active_dims": 8}))
    reference = assert_encodes_as_reference(sparse_embedder(path), path, enc.texts)
    assert ((reference > 0).sum(axis=1) == 8).all()


def test_a_masked_lm_without_sentence_transformers_files(splade_dir, tmp_path, enc):
    """`mode: sparse` on a bare `*ForMaskedLM` is SparseEncoder's default for one (max, relu);
    `mode: auto` serves it dense, as before."""
    path = tmp_path / "model"
    shutil.copytree(splade_dir, path)
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (path / name).unlink()
    shutil.rmtree(path / "1_SpladePooling")
    assert_encodes_as_reference(sparse_embedder(path), path, enc.texts)
    assert not serves_sparse(EmbeddingConfig(model=str(path)), Path("."))
    assert serves_sparse(EmbeddingConfig(model=str(splade_dir)), Path("."))
    assert not serves_sparse(EmbeddingConfig(model=str(splade_dir), mode="dense"), Path("."))


# --- settings that cannot work name their field ------------------------------------------------


@pytest.mark.parametrize(
    "params,key",
    [
        ({"mode": "colbert"}, "mode"),
        ({"mode": "sparse", "normalize": "true"}, "normalize"),
    ],
)
def test_bad_parameters_name_their_key(params, key):
    with pytest.raises(ConfigError) as info:
        from_parameters(EmbeddingConfig, params)
    assert info.value.key == key


def _edited(splade_dir: Path, target: Path, file: str, changes: dict | list) -> Path:
    """A copy of `splade_dir` whose JSON `file` has the keys `changes` (a list: is `changes`)."""
    shutil.copytree(splade_dir, target)
    data = json.loads((target / file).read_text())
    data = changes if isinstance(changes, list) else {**data, **changes}
    (target / file).write_text(json.dumps(data))
    return target


SPLADE_CONFIG = "1_SpladePooling/config.json"
MODULE = "sentence_transformers.sparse_encoder.modules.{}"


@pytest.mark.parametrize(
    "file,changes,match",
    [
        (SPLADE_CONFIG, dict(pooling_strategy="mean"), "pooling_strategy 'mean'"),
        (SPLADE_CONFIG, dict(activation_function="gelu"), "activation_function 'gelu'"),
        (SPLADE_CONFIG, dict(embedding_dimension=7), "embedding_dimension 7"),
        ("sentence_bert_config.json", dict(transformer_task="feature-extraction"), "fill-mask"),
        (
            "modules.json",
            [
                {"idx": 0, "path": "", "type": MODULE.format("MLMTransformer")},
                {"idx": 1, "path": "1_SpladePooling", "type": MODULE.format("SpladePooling")},
                {"idx": 2, "path": "2_SAE", "type": MODULE.format("SparseAutoEncoder")},
            ],
            "SparseAutoEncoder",
        ),
        ("config_sentence_transformers.json", dict(max_active_dims=0), "max_active_dims"),
    ],
)
def test_unsupported_checkpoints_are_refused(splade_dir, tmp_path, file, changes, match):
    path = _edited(splade_dir, tmp_path / "model", file, changes)
    with pytest.raises(ConfigError, match=match) as info:
        sparse_embedder(path)
    assert info.value.key == "model"


def test_sparse_needs_a_masked_lm_head(tiny_bert_dir):
    with pytest.raises(ConfigError, match=r"\*ForMaskedLM") as info:
        sparse_embedder(tiny_bert_dir)
    assert info.value.key == "model"


def test_dense_mode_refuses_a_splade_checkpoint(splade_dir):
    from backend_lib.encoder.embedder import Embedder

    config = EmbeddingConfig(model=str(splade_dir), mode="dense")
    with pytest.raises(ConfigError, match="Transformer"):
        Embedder.from_config(config, CPU, Path("."))
    assert isinstance(sparse_embedder(splade_dir), SparseEmbedder)
