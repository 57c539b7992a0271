"""End to end: `/v1/embeddings` `prompt_name`, `input_type` and `dimensions` through the frontend
and a real tritonserver serving a MiniLM copy that declares prompts and matryoshka_dimensions, against
sentence-transformers itself."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest

from tests.encoder.encoder_helpers import prompt_checkpoint
from tests.openai.frontend_helpers import Frontend, cosine, served_repository
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e
TEXTS = ["what smells sweet?", "the rose smells sweet", "a storm at sea"]


@dataclass
class Served:
    checkpoint: Path
    front: Frontend


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """The prompt-declaring MiniLM copy behind one tritonserver and one frontend (both tests)."""
    root = tmp_path_factory.mktemp("embedding-prompts")
    checkpoint = prompt_checkpoint(root / "checkpoint")
    repository = root / "repository"
    parameters = {"model": str(checkpoint), "dtype": "float32"}
    write_model(ModelSpec("embedding", "embedding", parameters), repository)
    with served_repository(repository) as front:
        yield Served(checkpoint, front)


def test_prompts_and_dimensions_match_sentence_transformers(served):
    from sentence_transformers import SentenceTransformer

    checkpoint, front = served.checkpoint, served.front
    sdk = openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)

    def vectors(**fields) -> np.ndarray:
        reply = sdk.embeddings.create(model="embedding", input=TEXTS, **fields)
        return np.array([d.embedding for d in reply.data])

    full = SentenceTransformer(str(checkpoint), device="cpu", local_files_only=True)
    cut = SentenceTransformer(
        str(checkpoint), device="cpu", local_files_only=True, truncate_dim=128
    )
    query = full.encode(TEXTS, prompt_name="query")
    assert cosine(vectors(extra_body={"prompt_name": "query"}), query).min() >= 0.99999
    assert cosine(vectors(extra_body={"input_type": "search_query"}), query).min() >= 0.99999
    document = cut.encode(TEXTS, prompt_name="document", normalize_embeddings=True)
    got = vectors(dimensions=128, extra_body={"input_type": "passage"})
    assert got.shape == (3, 128) and cosine(got, document).min() >= 0.99999

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


def test_tei_embed_matches_embeddings_and_sentence_transformers(served):
    """TEI's `/embed`: the vectors of `/v1/embeddings`; `prompt_name` and `dimensions` as
    sentence-transformers computes them; `normalize: false` the unnormalised pooled vectors of
    this checkpoint (which normalises by default)."""
    import httpx
    from sentence_transformers import SentenceTransformer

    checkpoint, front = served.checkpoint, served.front
    client = httpx.Client(base_url=front.url, timeout=120)

    def embed(**fields) -> np.ndarray:
        reply = client.post("/embed", json={"inputs": TEXTS, **fields})
        assert reply.status_code == 200, reply.text
        return np.array(reply.json())

    sdk = openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)
    reply = sdk.embeddings.create(model="embedding", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(embed(), [d.embedding for d in reply.data], atol=1e-6)
    one = client.post("/embed", json={"inputs": TEXTS[0]}).json()
    np.testing.assert_allclose(one, [reply.data[0].embedding], atol=1e-6)

    full = SentenceTransformer(str(checkpoint), device="cpu", local_files_only=True)
    cut = SentenceTransformer(
        str(checkpoint), device="cpu", local_files_only=True, truncate_dim=128
    )
    query = full.encode(TEXTS, prompt_name="query")
    assert cosine(embed(prompt_name="query"), query).min() >= 0.99999
    document = cut.encode(TEXTS, prompt_name="document", normalize_embeddings=True)
    got = embed(prompt_name="document", dimensions=128)
    assert got.shape == (3, 128) and cosine(got, document).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)

    pooled = SentenceTransformer(modules=[full[0], full[1]], device="cpu").encode(TEXTS)
    raw = embed(normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(raw, pooled, rtol=1e-4, atol=1e-5)

    bad_size = client.post("/embed", json={"inputs": TEXTS, "dimensions": 100})
    assert bad_size.status_code == 400
    error = bad_size.json()["error"]
    assert error["param"] == "dimensions" and "64, 128, 256, 384" in error["message"]
    bad_prompt = client.post("/embed", json={"inputs": TEXTS, "prompt_name": "passage"})
    assert bad_prompt.status_code == 400
    assert "'query', 'document'" in bad_prompt.json()["error"]["message"]
    long = "the rose smells sweet " * 200
    refused = client.post("/embed", json={"inputs": [long], "truncate": False})
    assert refused.status_code == 400 and "truncation is off" in refused.text
    assert client.post("/embed", json={"inputs": [long], "truncate": True}).status_code == 200
    client.close()
