"""TEI's `POST /embed` against a stand-in for tritonserver (no server): its fields reach the
embedding model as its inputs, the answer is TEI's bare list of vectors, and the model's errors
come back as /v1/embeddings' do. The vectors themselves: test_embedding_prompts_api.py (e2e)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backend_lib import contract
from backend_lib.errors import InputError, response_error
from openai_frontend.errors import from_triton_exception
from tests.openai.fake_triton_helpers import FakeTriton, fake_app
from tooling.checkpoints import MINILM_DIR
from tooling.repository import ModelSpec, write_model

EMBEDDING = ModelSpec("embedding", "embedding", {"model": str(MINILM_DIR)})


class RecordingTriton(FakeTriton):
    """Answers each row with [row, 1, 1] and records every request's inputs."""

    def __init__(self, error: Exception | None = None):
        super().__init__([EMBEDDING], {})
        self.inputs: list[dict[str, np.ndarray]] = []
        self.error = error

    async def infer(self, model, inputs, outputs, version="", timeout_us=None):
        self.inputs.append(inputs)
        if self.error is not None:
            raise self.error
        rows = len(next(iter(inputs.values())))
        vectors = np.ones((rows, 3), dtype=np.float32)
        vectors[:, 0] = np.arange(rows)
        return {
            contract.EMBEDDING: vectors,
            contract.NUM_INPUT_TOKENS: np.full((rows, 1), 2, dtype=np.uint32),
        }


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_model(EMBEDDING, tmp_path)
    return tmp_path


def test_embed_answers_a_bare_list_and_sends_teis_defaults(repository):
    fake = RecordingTriton()
    with fake_app(repository, fake) as client:
        reply = client.post("/embed", json={"inputs": ["a", "b"]})
        assert reply.status_code == 200, reply.text
        assert reply.json() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
        sent = fake.inputs[-1]
        assert sent[contract.NORMALIZE].tolist() == [[True], [True]]  # TEI's default
        assert contract.TRUNCATE not in sent  # the model's own setting
        assert contract.PROMPT_NAME not in sent and contract.DIMENSIONS not in sent

        one = client.post("/embed", json={"inputs": "a"})
        assert one.status_code == 200 and one.json() == [[0.0, 1.0, 1.0]]


def test_embed_fields_become_the_models_inputs(repository):
    fake = RecordingTriton()
    body = {
        "inputs": ["a", "b"],
        "normalize": False,
        "truncate": True,
        "truncation_direction": "Right",
        "prompt_name": "query",
        "dimensions": 128,
    }
    with fake_app(repository, fake) as client:
        assert client.post("/embed", json=body).status_code == 200
    sent = fake.inputs[-1]
    assert sent[contract.NORMALIZE].dtype == np.bool_
    assert sent[contract.NORMALIZE].tolist() == [[False], [False]]
    assert sent[contract.TRUNCATE].tolist() == [[True], [True]]
    assert sent[contract.PROMPT_NAME].tolist() == [[b"query"], [b"query"]]
    assert sent[contract.DIMENSIONS].dtype == np.int32
    assert sent[contract.DIMENSIONS].tolist() == [[128], [128]]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"inputs": []}, "inputs"),
        ({"inputs": ["a"], "truncation_direction": "Left"}, "truncation_direction"),
        ({"inputs": ["a"], "dimensions": 0}, "dimensions"),
        ({}, "inputs"),
    ],
)
def test_embed_refuses_what_it_cannot_honour(repository, body, param):
    fake = RecordingTriton()
    with fake_app(repository, fake) as client:
        reply = client.post("/embed", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].split(".")[0] == param  # pydantic: `inputs.str`
    assert fake.inputs == []


def test_a_model_error_names_its_field(repository):
    message = "'dimensions' 100 is not one of this model's sizes: 64, 128, 256, 384"
    error = from_triton_exception(_triton_error(InputError(message)))
    fake = RecordingTriton(error)
    with fake_app(repository, fake) as client:
        reply = client.post("/embed", json={"inputs": ["a"], "dimensions": 100})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "dimensions"
    assert "64, 128, 256, 384" in reply.json()["error"]["message"]


def _triton_error(exc: Exception) -> InferenceServerException:
    """The exception tritonclient raises for a model's error `exc` (what model.py sends)."""
    _, message = response_error(exc)
    return InferenceServerException(msg=message, status="StatusCode.INVALID_ARGUMENT")
