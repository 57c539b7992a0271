"""Rerankers against sentence-transformers: cross-encoders (tiny random BERT and XLM-R
classifiers) against `CrossEncoder.predict`, the bi-encoder against embedding cosines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.encoder.config import RerankConfig
from backend_lib.encoder.reranker import BiEncoderReranker, CrossEncoderReranker, load_reranker
from backend_lib.errors import InputError

CPU = torch.device("cpu")
IDENTITY = "torch.nn.modules.linear.Identity"


def pairs(texts: list[str]) -> tuple[list[str], list[str]]:
    queries = ["what is a fox?", "Привет", "long query " * 80, "", "数据"] * 2
    documents = (texts * 2)[: len(queries)]
    return queries, documents


def cross_encoder(path: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def bert_classifier_dir(tmp_path_factory, enc) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(2)
    target = tmp_path_factory.mktemp("bert_ce")
    BertForSequenceClassification(enc.tiny_bert_config(num_labels=1)).save_pretrained(target)
    enc.copy_minilm_tokenizer(target)
    return target


@pytest.fixture(scope="module")
def xlmr_classifier_dir(tmp_path_factory, enc) -> Path:
    """XLM-R classifier whose sentence-transformers activation is Identity (raw logits)."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    target = tmp_path_factory.mktemp("xlmr_ce")
    # As real XLM-R checkpoints: model_max_length (512 there) = position table - 2.
    vocab_size = enc.build_xlmr_tokenizer(target, model_max_length=128)
    config = XLMRobertaConfig(
        **enc.tiny_bert_config(vocab_size=vocab_size, max_position_embeddings=130).to_dict()
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id, config.type_vocab_size = (
        1,
        0,
        2,
        1,
    )
    config.num_labels = 1
    config.sentence_transformers = {"activation_fn": IDENTITY}
    torch.manual_seed(3)
    XLMRobertaForSequenceClassification(config).save_pretrained(target)
    return target


@pytest.mark.parametrize("checkpoint", ["bert_classifier_dir", "xlmr_classifier_dir"])
def test_cross_encoder_matches_sentence_transformers(checkpoint, request, enc):
    path = request.getfixturevalue(checkpoint)
    reranker = load_reranker(RerankConfig(dtype="float32", model=str(path)), CPU, Path("."))
    assert isinstance(reranker, CrossEncoderReranker)
    reference = cross_encoder(path)
    assert reranker.max_seq_length == reference.max_seq_length == 128
    queries, documents = pairs(enc.texts)
    items = reranker.tokenize(queries, documents)
    raw, batches = reranker.score(items, apply_sigmoid=False)
    logits = reference.predict(
        list(zip(queries, documents, strict=True)), activation_fn=torch.nn.Identity()
    )
    assert np.ptp(logits) > 0.05  # random weights still separate the pairs
    np.testing.assert_allclose(raw, logits, atol=1e-4)
    np.testing.assert_allclose(
        reranker.score(items, apply_sigmoid=True)[0], 1 / (1 + np.exp(-logits)), atol=1e-4
    )
    default = reference.predict(
        list(zip(queries, documents, strict=True))
    )  # checkpoint's activation
    np.testing.assert_allclose(reranker.predict(queries, documents), default, atol=1e-4)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(queries)))


def test_cross_encoder_activation_follows_checkpoint(bert_classifier_dir, xlmr_classifier_dir):
    bert = load_reranker(
        RerankConfig(dtype="float32", model=str(bert_classifier_dir)), CPU, Path(".")
    )
    xlmr = load_reranker(
        RerankConfig(dtype="float32", model=str(xlmr_classifier_dir)), CPU, Path(".")
    )
    assert (bert.activation, xlmr.activation) == ("sigmoid", "identity")
    forced = load_reranker(
        RerankConfig(dtype="float32", model=str(xlmr_classifier_dir), apply_sigmoid=True),
        CPU,
        Path("."),
    )
    scores = forced.predict(["q"], ["d"])
    assert (
        0 < scores[0] < 1
        and forced.predict(["q"], ["d"], apply_sigmoid=False)[0] == xlmr.predict(["q"], ["d"])[0]
    )


def test_cross_encoder_input_errors(bert_classifier_dir):
    reranker = load_reranker(
        RerankConfig(dtype="float32", model=str(bert_classifier_dir)), CPU, Path(".")
    )
    with pytest.raises(InputError, match="2 queries but 1 documents"):
        reranker.tokenize(["a", "b"], ["c"])
    with pytest.raises(
        InputError, match=r"query-document pair 1 has \d+ tokens, over the limit of 128"
    ):
        reranker.tokenize(["a", "b"], ["c", "word " * 200], truncate=False)
    assert max(len(ids) for ids, _ in reranker.tokenize(["q " * 300], ["d " * 300])) == 128
    scores, batches = reranker.score(reranker.tokenize([], []))
    assert scores.shape == (0,) and batches == []


def test_multi_label_classifier_is_refused(tmp_path, enc):
    from transformers import BertForSequenceClassification

    BertForSequenceClassification(enc.tiny_bert_config(num_labels=3)).save_pretrained(tmp_path)
    enc.copy_minilm_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="one label"):
        load_reranker(RerankConfig(dtype="float32", model=str(tmp_path)), CPU, Path("."))


def test_bi_encoder_scores_are_embedding_cosines(enc, minilm, minilm_st):
    reranker = load_reranker(RerankConfig(dtype="float32"), CPU, Path("."))
    assert isinstance(reranker, BiEncoderReranker)
    queries, documents = pairs([text[:300] for text in enc.texts])  # long texts: test_embedder
    scores, batches = reranker.score(reranker.tokenize(queries, documents))
    # Each distinct text (query or document) is embedded once; batches list the pairs.
    distinct = sorted(set(queries) | set(documents))
    assert len(distinct) < 2 * len(queries)
    assert sum(b.real_tokens for b in batches) == sum(len(ids) for ids in minilm.tokenize(distinct))
    assert set().union(*(b.indices for b in batches)) == set(range(len(queries)))
    assert reranker.score(reranker.tokenize([], []))[0].shape == (0,)
    q, d = minilm.encode(queries), minilm.encode(documents)
    np.testing.assert_allclose(scores, (q * d).sum(1), atol=1e-6)

    from sentence_transformers import util

    reference = (
        util.cos_sim(minilm_st.encode(queries), minilm_st.encode(documents)).diagonal().numpy()
    )
    np.testing.assert_allclose(scores, reference, atol=2e-5)
    sigmoid = reranker.predict(queries, documents, apply_sigmoid=True)
    np.testing.assert_allclose(sigmoid, 1 / (1 + np.exp(-scores)), atol=1e-6)


def test_mode_can_force_bi_encoder_on_a_classifier(bert_classifier_dir):
    config = RerankConfig(dtype="float32", model=str(bert_classifier_dir), mode="bi_encoder")
    assert isinstance(load_reranker(config, CPU, Path(".")), BiEncoderReranker)
