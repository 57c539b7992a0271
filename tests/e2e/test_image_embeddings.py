"""End to end: a random CLIP checkpoint served by a real tritonserver and the OpenAI frontend:
images over Triton's HTTP API (`image`, raw bytes and base64 text) and over `/v1/embeddings`
(vLLM's `messages` form), texts beside them, against the checkpoint's own transformers processor
and model; a bad image fails its own request."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.encoder.image_helpers import Reference, cosine, pictures, truncated_png
from tests.openai.frontend_helpers import Frontend, served_with_server
from tooling.repository import ModelSpec, write_model
from tooling.tritonserver import TritonServer
from tooling.vision_checkpoints import build_clip

pytestmark = pytest.mark.e2e


@dataclass
class Served:
    checkpoint: Path
    server: TritonServer
    front: Frontend


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("image-embeddings")
    checkpoint = build_clip(root / "clip")
    repository = root / "repository"
    parameters = {"model": str(checkpoint), "dtype": "float32"}
    write_model(ModelSpec("clip", "embedding", parameters), repository)
    with served_with_server(repository) as (server, front):
        yield Served(checkpoint, server, front)


def infer(url: str, name: str, rows: list[bytes]) -> np.ndarray:
    # Closed after each call: an open HTTP connection holds the server's stop for its exit timeout.
    client = httpclient.InferenceServerClient(url)
    try:
        data = np.array([[row] for row in rows], dtype=object)
        tensor = httpclient.InferInput(name, list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        return client.infer("clip", [tensor]).as_numpy("embedding")
    finally:
        client.close()


def test_images_and_texts_over_triton_and_the_frontend(served):
    reference = Reference(served.checkpoint)
    images = pictures()[:3]
    url = served.server.http_url
    assert cosine(infer(url, "image", images), reference.images(images)).min() >= 0.99999
    as_text = [base64.b64encode(image) for image in images[:1]]  # Triton's vLLM backend form
    assert cosine(infer(url, "image", as_text), reference.images(images[:1])).min() >= 0.99999
    texts = ["a photo of a cat", "a storm at sea"]
    encoded = [text.encode() for text in texts]
    assert cosine(infer(url, "text_input", encoded), reference.texts(texts)).min() >= 0.99999
    with pytest.raises(InferenceServerException, match="truncated or corrupt"):
        infer(url, "image", [truncated_png()])

    image_url = "data:image/jpeg;base64," + base64.b64encode(images[2]).decode()
    content = [{"type": "image_url", "image_url": {"url": image_url}}]
    body = {"model": "clip", "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{served.front.base_url}/embeddings", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    vector = np.array([reply.json()["data"][0]["embedding"]])
    assert cosine(vector, reference.images(images[2:])).min() >= 0.99999
