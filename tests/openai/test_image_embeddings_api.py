"""`/v1/embeddings` of CLIP and SigLIP models in vLLM's multimodal form (`messages` with one
`image_url` data URL, or text parts), and `input` texts, through the frontend's real route and a
stand-in for tritonserver that runs the embedding model's own service in-process: the vectors and
usage equal the checkpoint's transformers processor and model; malformed requests are 400s naming
`messages`, a bad image is the model's 400, and a good request beside them is still answered."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from backend_lib.encoder.service import EmbeddingService
from backend_lib.errors import response_error
from backend_lib.model_context import ModelContext
from openai_frontend.errors import from_triton_exception
from tests.encoder.image_helpers import Reference, cosine, gif, pictures, truncated_png
from tests.openai.fake_triton_helpers import FakeTriton, fake_app
from tooling.repository import ModelSpec, write_model
from tooling.vision_checkpoints import build_clip, build_siglip


class InProcessTriton(FakeTriton):
    """Answers `infer` with the embedding model's service (as model.py runs it, without the
    server), its errors turned into Triton's as the client receives them."""

    def __init__(self, spec: ModelSpec):
        super().__init__([spec], {})
        cpu = torch.device("cpu")
        context = ModelContext(spec.name, "1", Path("."), cpu, spec.parameters, {})
        self.service = EmbeddingService.from_context(context, None)

    async def infer(self, model, inputs, outputs, version="", timeout_us=None):
        (result,) = self.service.execute([dict(inputs)])
        if isinstance(result, Exception):
            _, message = response_error(result)
            error = InferenceServerException(msg=message, status="StatusCode.INVALID_ARGUMENT")
            raise from_triton_exception(error)
        return {name: result[name] for name in outputs}


@dataclass
class Served:
    client: TestClient
    reference: Reference
    repository: Path
    triton: InProcessTriton


@pytest.fixture(scope="module", params=["clip", "siglip"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp(request.param)
    build = build_clip if request.param == "clip" else build_siglip
    checkpoint = build(root / "checkpoint")
    spec = ModelSpec(request.param, "embedding", {"model": str(checkpoint), "dtype": "float32"})
    repository, triton = root / "repository", InProcessTriton(spec)
    write_model(spec, repository)
    with fake_app(repository, triton) as client:
        yield Served(client, Reference(checkpoint), repository, triton)


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode("ascii")


def image_message(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


def vectors(reply) -> np.ndarray:
    assert reply.status_code == 200, reply.text
    return np.array([item["embedding"] for item in reply.json()["data"]], dtype=np.float32)


def test_an_image_and_texts_equal_transformers(served):
    client, reference = served.client, served.reference
    image = pictures()[0]
    body = {"messages": image_message(data_url(image)), "encoding_format": "float"}
    reply = client.post("/v1/embeddings", json=body)
    assert cosine(vectors(reply), reference.images([image])).min() >= 0.99999
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == reference.image_token_count()
    as_base64 = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(as_base64.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, vectors(reply)[0])

    text = "a photo of a cat"
    parts = [{"type": "text", "text": "a photo "}, {"type": "text", "text": "of a cat"}]
    for request in (
        {"messages": [{"role": "user", "content": parts}]},
        {"messages": [{"role": "user", "content": text}]},
        {"input": [text]},
    ):
        reply = client.post("/v1/embeddings", json=request)
        assert cosine(vectors(reply), reference.texts([text])).min() >= 0.99999
        assert reply.json()["usage"]["prompt_tokens"] == reference.text_token_counts([text])[0]
    two = [{"role": "system", "content": "a dog"}, {"role": "user", "content": "a cat"}]
    reply = client.post("/v1/embeddings", json={"messages": two})
    assert cosine(vectors(reply), reference.texts(["a dog\na cat"])).min() >= 0.99999


@pytest.mark.parametrize(
    "body,param,message",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                            {"type": "text", "text": "a cat"},
                        ],
                    }
                ]
            },
            "messages",
            "not both",
        ),
        ({"messages": image_message("data:,") * 2}, "messages", "hold 2 images"),
        ({"messages": image_message("data:,"), "input": "a cat"}, "messages", "not both"),
        ({}, "input", "send `input` (texts or token ids) or `messages`"),
        ({"messages": image_message("file:///etc/hosts")}, "messages", "not allowed here"),
        ({"messages": image_message("https://example.com/a.png")}, "messages", "not allowed"),
        ({"messages": image_message("data:image/png,abc")}, "messages", "must be base64"),
    ],
)
def test_malformed_requests_are_400s_naming_the_field(served, body, param, message):
    reply = served.client.post("/v1/embeddings", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_bad_images_are_the_models_400s_and_a_good_one_is_answered(served):
    client = served.client
    for image, message in ((truncated_png(), "truncated or corrupt"), (gif(), "formats")):
        reply = client.post("/v1/embeddings", json={"messages": image_message(data_url(image))})
        assert reply.status_code == 400, reply.text
        assert "input 'image'[0]" in reply.json()["error"]["message"]
        assert message in reply.json()["error"]["message"]
    body = {"messages": image_message(data_url(pictures()[1])), "prompt_name": "query"}
    reply = client.post("/v1/embeddings", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_name"
    image = pictures()[2]
    reply = client.post("/v1/embeddings", json={"messages": image_message(data_url(image))})
    assert cosine(vectors(reply), served.reference.images([image])).min() >= 0.99999


def test_a_file_url_is_read_below_the_allowed_media_path(served, tmp_path):
    """The frontend's `allowed_local_media_path` (vLLM's --allowed-local-media-path)."""
    image = pictures()[3]
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.webp").write_bytes(image)
    settings = {"allowed_local_media_path": tmp_path / "media"}
    with fake_app(served.repository, served.triton, **settings) as client:
        url = (tmp_path / "media" / "a.webp").as_uri()
        reply = client.post("/v1/embeddings", json={"messages": image_message(url)})
        assert cosine(vectors(reply), served.reference.images([image])).min() >= 0.99999
        outside = image_message(Path("/etc/hosts").as_uri())
        reply = client.post("/v1/embeddings", json={"messages": outside})
        assert reply.status_code == 400 and "under the allowed directory" in reply.text
