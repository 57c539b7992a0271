"""End to end: `/v1/embeddings` `prompt_name`, `input_type` and `dimensions` through the frontend
and a real tritonserver serving a MiniLM copy that declares prompts and matryoshka_dimensions, against
sentence-transformers itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest

from tests.encoder.encoder_helpers import prompt_checkpoint
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e
TEXTS = ["what smells sweet?", "the rose smells sweet", "a storm at sea"]


def _cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_prompts_and_dimensions_match_sentence_transformers(
    tmp_path: Path, make_server, make_frontend
):
    from sentence_transformers import SentenceTransformer

    checkpoint = prompt_checkpoint(tmp_path / "checkpoint")
    repository = tmp_path / "repository"
    parameters = {"model": str(checkpoint), "dtype": "float32"}
    write_model(ModelSpec("embedding", "embedding", parameters), repository)
    server = make_server(repository)
    front = make_frontend(server.grpc_url, repository)
    sdk = openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)

    def vectors(**fields) -> np.ndarray:
        reply = sdk.embeddings.create(model="embedding", input=TEXTS, **fields)
        return np.array([d.embedding for d in reply.data])

    full = SentenceTransformer(str(checkpoint), device="cpu", local_files_only=True)
    cut = SentenceTransformer(
        str(checkpoint), device="cpu", local_files_only=True, truncate_dim=128
    )
    query = full.encode(TEXTS, prompt_name="query")
    assert _cosine(vectors(extra_body={"prompt_name": "query"}), query).min() >= 0.99999
    assert _cosine(vectors(extra_body={"input_type": "search_query"}), query).min() >= 0.99999
    document = cut.encode(TEXTS, prompt_name="document", normalize_embeddings=True)
    got = vectors(dimensions=128, extra_body={"input_type": "passage"})
    assert got.shape == (3, 128) and _cosine(got, document).min() >= 0.99999

    with pytest.raises(openai.BadRequestError) as bad_size:
        vectors(dimensions=100)
    error = bad_size.value.body
    assert error["param"] == "dimensions" and "64, 128, 256, 384" in error["message"]
    with pytest.raises(openai.BadRequestError) as bad_prompt:
        vectors(extra_body={"prompt_name": "passage"})
    assert "'query', 'document'" in bad_prompt.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad_type:
        vectors(extra_body={"input_type": "classification"})
    assert bad_type.value.body["param"] == "input_type"
    assert "search_document" in bad_type.value.body["message"]
