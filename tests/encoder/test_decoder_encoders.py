"""Decoder embedders and rerankers (Llama, Mistral, Qwen2, Qwen3 bodies on the LLM engine's
forward) against sentence-transformers: `SentenceTransformer.encode` for each pooling mode,
prompts and Matryoshka sizes, `CrossEncoder.predict` for `*ForSequenceClassification`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_lib.contract import EMBEDDING, SCORE
from backend_lib.encoder.config import EmbeddingConfig, RerankConfig
from backend_lib.encoder.embedder import Embedder
from backend_lib.encoder.packed_decoder import BLOCK_SIZE, PackedDecoderEncoder, shared_prefix
from backend_lib.encoder.reranker import CrossEncoderReranker, load_reranker
from backend_lib.encoder.service import EmbeddingService, RerankService
from backend_lib.errors import InputError
from tests.encoder.encoder_helpers import TEXTS, write_json, write_st_files
from tooling.checkpoints import build_decoder_body

CPU = torch.device("cpu")
# Each family with the pooling its real embedders use, and the other modes once each.
EMBEDDERS = [
    ("Qwen3ForCausalLM", "lasttoken"),
    ("Qwen2ForCausalLM", "lasttoken"),
    ("MistralForCausalLM", "lasttoken"),  # sliding window 7: shorter than most texts
    ("LlamaForCausalLM", "mean"),
    ("Qwen3ForCausalLM", "cls"),
]
PROMPTS = {"query": "Instruct: find the play\nQuery: ", "document": ""}


def _cosine_min(ours: np.ndarray, reference: np.ndarray) -> float:
    assert ours.shape == reference.shape and ours.dtype == np.float32
    cosine = (ours * reference).sum(-1) / (
        np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1)
    )
    return float(cosine.min())


def _embedder(path: Path) -> Embedder:
    return Embedder.from_config(EmbeddingConfig(model=str(path), dtype="float32"), CPU, path)


def _st(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def _embedder_dir(root: Path, arch: str, pooling: str) -> Path:
    path = build_decoder_body(arch, root / f"{arch}-{pooling}")
    write_st_files(path, pooling, normalize=True, max_seq_length=256)
    return path


@pytest.mark.parametrize(("arch", "pooling"), EMBEDDERS)
def test_decoder_embeddings_equal_sentence_transformers(tmp_path, arch, pooling):
    path = _embedder_dir(tmp_path, arch, pooling)
    ours = _embedder(path)
    assert isinstance(ours.encoder, PackedDecoderEncoder)
    # Batches of 4 mix lengths: the reference pads (left), ours packs.
    reference = _st(path).encode(TEXTS, batch_size=4, convert_to_numpy=True)
    assert _cosine_min(ours.encode(TEXTS), reference) >= 0.99999


@pytest.fixture(scope="module")
def prompted_decoder(tmp_path_factory) -> Path:
    """A Qwen3 last-token embedder declaring query/document prompts and Matryoshka sizes."""
    path = _embedder_dir(tmp_path_factory.mktemp("prompted"), "Qwen3ForCausalLM", "lasttoken")
    write_json(path / "config_sentence_transformers.json", {"prompts": PROMPTS})
    config = json.loads((path / "config.json").read_text())
    write_json(path / "config.json", {**config, "matryoshka_dimensions": [16, 32]})
    return path


def test_prompts_and_dimensions_equal_sentence_transformers(prompted_decoder):
    from sentence_transformers import SentenceTransformer

    ours = _embedder(prompted_decoder)
    reference = _st(prompted_decoder)
    for name in PROMPTS:
        expected = reference.encode(TEXTS, prompt_name=name, convert_to_numpy=True)
        assert _cosine_min(ours.encode(TEXTS, prompt_name=name), expected) >= 0.99999
    truncated = SentenceTransformer(
        str(prompted_decoder), device="cpu", local_files_only=True, truncate_dim=16
    ).encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    expected = truncated / np.linalg.norm(truncated, axis=-1, keepdims=True)
    got = ours.encode(TEXTS, prompt_name="query", dimensions=16)
    assert got.shape == (len(TEXTS), 16)
    assert _cosine_min(got, expected) >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, rtol=1e-5)


LONG_PROMPTS = {
    "query": "Instruct: Given a question about the plays, retrieve the lines of verse that answer "
    "it, the speaker named and the scene told\nQuery: "
}


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_a_shared_instruction_prefix_is_computed_once(tmp_path, monkeypatch, pooling):
    """Texts sharing a long instruction prompt: with last-token pooling its whole blocks are one
    sequence of the batch that the texts attend to (fewer rows computed), and the vectors still
    equal sentence-transformers'; mean pooling needs every row, so nothing is shared."""
    path = _embedder_dir(tmp_path, "Qwen3ForCausalLM", pooling)
    write_json(path / "config_sentence_transformers.json", {"prompts": LONG_PROMPTS})
    ours = _embedder(path)
    rows = []
    forward = ours.encoder.model.forward
    monkeypatch.setattr(
        ours.encoder.model,
        "forward",
        lambda ids, *rest: rows.append(len(ids)) or forward(ids, *rest),
    )
    expected = _st(path).encode(TEXTS, prompt_name="query", convert_to_numpy=True)
    assert _cosine_min(ours.encode(TEXTS, prompt_name="query"), expected) >= 0.99999
    tokens = sum(len(ids) for ids in ours.tokenize(TEXTS, prompt=LONG_PROMPTS["query"]))
    prompt_tokens = len(ours.tokenize([""], prompt=LONG_PROMPTS["query"])[0])
    if pooling == "mean":
        assert sum(rows) == tokens
    else:
        shared = (prompt_tokens - 2) // BLOCK_SIZE * BLOCK_SIZE  # less bos/eos, whole blocks
        assert shared >= BLOCK_SIZE and sum(rows) == tokens - shared * (len(TEXTS) - len(rows))


def test_shared_prefix_counts_whole_blocks_common_to_all():
    b = BLOCK_SIZE
    common = np.arange(2 * b + 3)
    ids = np.concatenate((common, [7, 8], common, [9], common[: b + 2], [5]))
    lengths = np.array([2 * b + 5, 2 * b + 4, b + 3])
    assert shared_prefix(ids, lengths, 10 * b) == b  # the third has only one whole block
    assert shared_prefix(ids[: 4 * b + 9], lengths[:2], 10 * b) == 2 * b
    assert shared_prefix(ids[: 4 * b + 9], lengths[:2], 2 * b - 1) == b  # the limit, in blocks
    other = ids.copy()
    other[2 * b + 5] += 1  # the second sequence differs at its first token
    assert shared_prefix(other, lengths, 10 * b) == 0


def _text_request(texts, **extra) -> dict:
    return {"text_input": np.array([[t.encode()] for t in texts], dtype=object), **extra}


def test_bad_requests_fail_alone(prompted_decoder):
    service = EmbeddingService(_embedder(prompted_decoder))
    good = _text_request(TEXTS[:2])
    bad_prompt = _text_request(["x"], prompt_name=np.array([[b"passage"]], dtype=object))
    bad_size = _text_request(["x"], dimensions=np.array([[20]], dtype=np.int32))
    too_long = _text_request(["word " * 400], truncate=np.array([[False]]))
    results = service.execute([bad_prompt, good, bad_size, too_long])
    assert isinstance(results[0], InputError) and "'query', 'document'" in str(results[0])
    assert isinstance(results[2], InputError) and "16, 32, 64" in str(results[2])
    assert isinstance(results[3], InputError) and "truncation is off" in str(results[3])
    alone = service.execute([good])[0][EMBEDDING]
    np.testing.assert_allclose(results[1][EMBEDDING], alone, rtol=1e-5, atol=1e-6)


QUERIES = ["what smells sweet?"] * 3 + ["who is the king", "x", "long query " * 90]
DOCUMENTS = ["the rose smells sweet", "a long document " * 30, "", "the king is Lear", "y", "z"]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decoder_cross_encoder_scores_equal_sentence_transformers(tmp_path, arch):
    from sentence_transformers import CrossEncoder

    path = build_decoder_body(arch, tmp_path / "ce", num_labels=1)
    reference = CrossEncoder(str(path), device="cpu", local_files_only=True)
    expected = reference.predict(list(zip(QUERIES, DOCUMENTS, strict=True)), batch_size=3)
    ours = load_reranker(RerankConfig(model=str(path), dtype="float32"), CPU, path)
    assert isinstance(ours, CrossEncoderReranker)
    assert isinstance(ours.encoder, PackedDecoderEncoder)
    np.testing.assert_allclose(ours.predict(QUERIES, DOCUMENTS), expected, atol=1e-4)
    # Through the service too, ordering and all.
    inputs = {
        "query": np.array([[q.encode()] for q in QUERIES], dtype=object),
        "document": np.array([[d.encode()] for d in DOCUMENTS], dtype=object),
    }
    scores = RerankService(ours).execute([inputs])[0][SCORE][:, 0]
    assert list(np.argsort(-scores)) == list(np.argsort(-expected))


def test_a_pad_token_inside_the_pair_is_skipped_as_transformers_does(tmp_path):
    """transformers scores a decoder classifier on the rightmost non-pad token: a text ending in
    the pad token (here the appended end token is made the pad) is scored before it."""
    from transformers import AutoModelForSequenceClassification

    path = build_decoder_body("Qwen2ForCausalLM", tmp_path / "ce", num_labels=1, pad_token_id=2)
    ours = load_reranker(RerankConfig(model=str(path), dtype="float32"), CPU, path)
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    ids = ours.tokenize(["a query"], ["a document"])[0][0]
    assert ids[-1] == 2
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, 0].item()
    raw = ours.score(ours.tokenize(["a query"], ["a document"]), apply_sigmoid=False)[0][0]
    assert raw == pytest.approx(expected, abs=1e-4)


def test_a_decoder_without_its_score_head_is_refused(tmp_path):
    from backend_lib.config import ConfigError

    path = build_decoder_body("Qwen3ForCausalLM", tmp_path / "body")
    config = json.loads((path / "config.json").read_text())
    write_json(
        path / "config.json",
        {
            **config,
            "architectures": ["Qwen3ForSequenceClassification"],
            "id2label": {"0": "LABEL_0"},
        },
    )
    with pytest.raises(ConfigError, match="score.weight"):
        load_reranker(RerankConfig(model=str(path), dtype="float32"), CPU, path)
