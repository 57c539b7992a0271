"""End to end: a Qwen3 decoder embedder (last-token pooling, prompts, Matryoshka sizes), a Qwen3
`*ForSequenceClassification` reranker and a causal-LM reranker (Qwen3-Reranker's original form:
chat template, yes/no logits) served beside the default llm, embedding and rerank models by one
real tritonserver, through the OpenAI frontend, against sentence-transformers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.encoder.encoder_helpers import write_json, write_st_files
from tests.openai.frontend_helpers import Frontend, cosine, served_repository
from tooling.checkpoints import build_causal_reranker, build_decoder_body
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e
REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["what smells sweet?", "the rose smells sweet", "a storm at sea " * 20]
PROMPTS = {"query": "Instruct: find the line\nQuery: ", "document": ""}
QUERY = "who is the king"
DOCUMENTS = ["the king is Lear", "a rose", "Lear, king of Britain, divides his realm", "x"]


@dataclass
class Served:
    embedder: Path
    reranker: Path
    causal_reranker: Path
    front: Frontend


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("decoder-retrieval")
    embedder = build_decoder_body("Qwen3ForCausalLM", root / "qwen3-embedding")
    write_st_files(embedder, "lasttoken", normalize=True, max_seq_length=256)
    write_json(embedder / "config_sentence_transformers.json", {"prompts": PROMPTS})
    config = json.loads((embedder / "config.json").read_text())
    write_json(embedder / "config.json", {**config, "matryoshka_dimensions": [16, 32]})
    reranker = build_decoder_body("Qwen3ForCausalLM", root / "qwen3-reranker", num_labels=1)
    causal = build_causal_reranker(
        root / "qwen3-causal-reranker",
        prompts={"plays": "Find the line that answers"},
        default_prompt_name="plays",
    )
    # The default repository as it is (its models found at ../../models), plus the two.
    repository = root / "serving" / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository)
    (root / "serving" / "models").symlink_to(REPO_ROOT / "models")
    for name, kind, checkpoint in (
        ("qwen3_embedding", "embedding", embedder),
        ("qwen3_rerank", "rerank", reranker),
        ("qwen3_causal_rerank", "rerank", causal),
    ):
        parameters = {"model": str(checkpoint), "dtype": "float32"}
        write_model(ModelSpec(name, kind, parameters), repository)
    with served_repository(repository) as front:
        yield Served(embedder, reranker, causal, front)


def test_decoder_embeddings_prompts_and_dimensions(served):
    from sentence_transformers import SentenceTransformer

    sdk = openai.OpenAI(base_url=served.front.base_url, api_key="unused", max_retries=0)

    def vectors(model="qwen3_embedding", **fields) -> np.ndarray:
        reply = sdk.embeddings.create(model=model, input=TEXTS, **fields)
        return np.array([d.embedding for d in reply.data])

    path = str(served.embedder)
    full = SentenceTransformer(path, device="cpu", local_files_only=True)
    assert cosine(vectors(), full.encode(TEXTS)).min() >= 0.99999
    query = full.encode(TEXTS, prompt_name="query")
    assert cosine(vectors(extra_body={"prompt_name": "query"}), query).min() >= 0.99999
    cut = SentenceTransformer(path, device="cpu", local_files_only=True, truncate_dim=16)
    expected = cut.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    got = vectors(dimensions=16, extra_body={"input_type": "query"})
    assert got.shape == (3, 16) and cosine(got, expected).min() >= 0.99999
    with pytest.raises(openai.BadRequestError) as bad_size:
        vectors(dimensions=20)
    assert bad_size.value.body["param"] == "dimensions"
    assert "16, 32, 64" in bad_size.value.body["message"]
    # The default embedding model beside it still answers.
    assert vectors(model="embedding").shape == (3, 384)


@pytest.mark.parametrize(
    ("model", "checkpoint"),
    [("qwen3_rerank", "reranker"), ("qwen3_causal_rerank", "causal_reranker")],
)
def test_decoder_reranker_orders_as_cross_encoder(served, model, checkpoint):
    from sentence_transformers import CrossEncoder

    path = str(getattr(served, checkpoint))
    reference = CrossEncoder(path, device="cpu", local_files_only=True)
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    client = httpx.Client(base_url=served.front.url, timeout=120)
    body = {"model": model, "query": QUERY, "documents": DOCUMENTS}
    reply = client.post("/v1/rerank", json=body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected))
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-4
    )
    default = client.post("/v1/rerank", json={**body, "model": "rerank"})
    assert default.status_code == 200 and len(default.json()["results"]) == len(DOCUMENTS)
