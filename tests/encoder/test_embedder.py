"""Embedder against sentence-transformers: real all-MiniLM-L6-v2 weights and tiny random
checkpoints with other pooling / normalisation / tokenizer settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backend_lib.encoder.attention import PaddedAttention
from backend_lib.encoder.config import EmbeddingConfig
from backend_lib.encoder.embedder import Embedder
from backend_lib.errors import InputError

CPU = torch.device("cpu")
ONE_MB_TEXT = "lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 18000


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def sentence_transformer(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def test_minilm_matches_sentence_transformers(minilm, minilm_st, enc):
    texts = [*enc.texts, ONE_MB_TEXT]
    expected = minilm_st.encode(texts)
    got = minilm.encode(texts)
    assert got.shape == expected.shape == (len(texts), 384) and got.dtype == np.float32
    assert cosine(got, expected).min() >= 0.99999
    np.testing.assert_allclose(got, expected, atol=2e-5)
    assert minilm.normalize_default and minilm.max_seq_length == minilm_st.max_seq_length == 256
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_results_independent_of_micro_batching(minilm, enc):
    tokens = minilm.tokenize(enc.texts)
    reference, _ = minilm.embed(tokens)
    small = Embedder.from_config(
        EmbeddingConfig(dtype="float32", max_batch_tokens=300, max_batch_size=3), CPU, Path(".")
    )
    got, batches = small.embed(tokens)
    np.testing.assert_allclose(got, reference, atol=1e-6)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(enc.texts)))
    for batch in batches:
        assert len(batch.indices) <= 3 and batch.padded_tokens <= 300
        assert batch.real_tokens == sum(len(tokens[i]) for i in batch.indices) and batch.seconds > 0


def test_padded_attention_path_matches_sentence_transformers(minilm_st, enc):
    """The GPU default (one masked attention per micro-batch), checked here on CPU."""
    embedder = Embedder.from_config(
        EmbeddingConfig(dtype="float32", max_batch_tokens=2048), CPU, Path(".")
    )
    embedder.encoder.attention = PaddedAttention()
    texts = [*enc.texts[:4], *(f"sentence {i} " * i for i in range(1, 40, 3))]
    got, batches = embedder.embed(embedder.tokenize(texts))
    assert any(len({len(embedder.tokenize([texts[i]])[0]) for i in b.indices}) > 1 for b in batches)
    np.testing.assert_allclose(got, minilm_st.encode(texts), atol=2e-5)


def test_normalize_override(minilm, minilm_st, enc):
    raw = minilm.encode(enc.texts, normalize=False)
    norms = np.linalg.norm(raw, axis=1)
    assert (np.abs(norms - 1) > 1e-3).all()
    np.testing.assert_allclose(raw / norms[:, None], minilm_st.encode(enc.texts), atol=2e-5)


def test_truncation_off_rejects_long_items_by_index(minilm):
    assert len(minilm.tokenize(["word " * 1000])[0]) == 256
    with pytest.raises(InputError, match=r"text 1 has \d+ tokens, over the limit of 256"):
        minilm.tokenize(["fine", "word " * 1000], truncate=False)
    with pytest.raises(InputError, match="text 0 is 1026000 bytes"):
        minilm.tokenize([ONE_MB_TEXT], truncate=False)
    with pytest.raises(InputError, match="text 1: expected a string"):
        minilm.tokenize(["ok", None])
    with pytest.raises(InputError, match="item 0 has 0 tokens"):
        minilm.embed([[]])


def test_empty_call(minilm):
    vectors, batches = minilm.embed([])
    assert vectors.shape == (0, 384) and batches == []
    assert minilm.tokenize([]) == [] and minilm.encode([]).shape == (0, 384)


def test_bfloat16_close_to_float32(minilm, enc):
    bf16 = Embedder.from_config(EmbeddingConfig(dtype="bfloat16"), CPU, Path("."))
    assert cosine(bf16.encode(enc.texts), minilm.encode(enc.texts)).min() > 0.99


# --- other pooling, normalisation, families, tokenizer settings on tiny random checkpoints ---


def _link_model(source: Path, target: Path) -> None:
    target.mkdir()
    for item in source.iterdir():
        if item.is_file():
            (target / item.name).symlink_to(item)


@pytest.mark.parametrize(
    "pooling,normalize",
    [
        ("cls", True),
        ("cls", False),
        ("max", False),
        ("weightedmean", False),
        ("lasttoken", False),
        ("mean_sqrt_len_tokens", False),
        (["cls", "mean", "max"], False),
    ],
)
def test_tiny_bert_pooling_matches_sentence_transformers(
    tiny_bert_dir, tmp_path, pooling, normalize, enc
):
    model_dir = tmp_path / "model"
    _link_model(tiny_bert_dir, model_dir)
    enc.write_st_files(model_dir, pooling, normalize, max_seq_length=64)
    embedder = Embedder.from_config(
        EmbeddingConfig(dtype="float32", model=str(model_dir)), CPU, Path(".")
    )
    expected = sentence_transformer(model_dir).encode(enc.texts)
    got = embedder.encode(enc.texts)
    assert embedder.normalize_default is normalize and embedder.dim == expected.shape[1]
    assert cosine(got, expected).min() >= 0.99999
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_plain_hf_checkpoint_uses_mean_pooling_like_sentence_transformers(tiny_bert_dir, enc):
    embedder = Embedder.from_config(
        EmbeddingConfig(dtype="float32", model=str(tiny_bert_dir)), CPU, Path(".")
    )
    expected = sentence_transformer(tiny_bert_dir).encode(enc.texts)
    assert embedder.max_seq_length == 128 and not embedder.normalize_default
    np.testing.assert_allclose(embedder.encode(enc.texts), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_xlmr_dir(tmp_path_factory, enc) -> Path:
    """Random XLMRobertaModel with a cased XLM-R-style tokenizer and do_lower_case=True."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    target = tmp_path_factory.mktemp("tiny_xlmr")
    vocab_size = enc.build_xlmr_tokenizer(target, lowercase=False)
    torch.manual_seed(1)
    config = XLMRobertaConfig(
        **enc.tiny_bert_config(vocab_size=vocab_size, max_position_embeddings=66).to_dict()
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id, config.type_vocab_size = (
        1,
        0,
        2,
        1,
    )
    XLMRobertaModel(config).save_pretrained(target)
    enc.write_st_files(target, "mean", True, max_seq_length=64)
    enc.write_json(
        target / "sentence_bert_config.json", {"max_seq_length": 64, "do_lower_case": True}
    )
    return target


def test_tiny_xlmr_lowercase_matches_sentence_transformers(tiny_xlmr_dir, enc):
    embedder = Embedder.from_config(
        EmbeddingConfig(dtype="float32", model=str(tiny_xlmr_dir)), CPU, Path(".")
    )
    assert embedder.tokenize(["Hello"]) == embedder.tokenize(["hello"])
    texts = [*enc.texts, "Mixed CASE words <pad> around a literal pad token"]
    expected = sentence_transformer(tiny_xlmr_dir).encode(texts)
    np.testing.assert_allclose(embedder.encode(texts), expected, atol=1e-5, rtol=1e-5)
