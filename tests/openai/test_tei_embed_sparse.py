"""TEI's `POST /embed_sparse` against a stand-in for tritonserver (no server): its fields reach the
sparse embedding model as its inputs, the padded `indices` / `values` rows come back as TEI's
`[[{"index", "value"}, ...], ...]` in input order, and the frontend tells a sparse embedding model
from a dense one by its Triton config. The vectors themselves: test_sparse_embedding_api.py (e2e)."""

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

DENSE = ModelSpec("embedding", "embedding", {"model": str(MINILM_DIR)})
SPARSE = ModelSpec("splade", "embedding", {"model": str(MINILM_DIR), "mode": "sparse"})
SPARSE.max_batch_size = 2  # several Triton requests per call: their rows go back in order


class SparseTriton(FakeTriton):
    """Text "t<k>" gets ids [k] for even k, [k, 1000 + k] for odd k, weights 0.5 and 1.5, each
    request's rows padded to its longest with -1 and 0; records every request's inputs."""

    def __init__(self, error: Exception | None = None):
        super().__init__([DENSE, SPARSE], {})
        self.inputs: list[dict[str, np.ndarray]] = []
        self.error = error

    async def infer(self, model, inputs, outputs, version="", timeout_us=None):
        if model != SPARSE.name:
            return await super().infer(model, inputs, outputs, version)
        self.inputs.append(inputs)
        if self.error is not None:
            raise self.error
        ks = [int(text[0].decode()[1:]) for text in inputs[contract.TEXT_INPUT]]
        width = max(1 + k % 2 for k in ks)
        indices = np.full((len(ks), width), contract.SPARSE_PAD_INDEX, dtype=np.int64)
        values = np.zeros((len(ks), width), dtype=np.float32)
        for row, k in enumerate(ks):
            ids = [k, 1000 + k][: 1 + k % 2]
            indices[row, : len(ids)], values[row, : len(ids)] = ids, [0.5, 1.5][: len(ids)]
        tokens = np.full((len(ks), 1), 3, dtype=np.uint32)
        by_name = {contract.INDICES: indices, contract.VALUES: values}
        return {**by_name, contract.NUM_INPUT_TOKENS: tokens}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for spec in (DENSE, SPARSE):
        write_model(spec, tmp_path)
    return tmp_path


def test_embed_sparse_answers_teis_shape_in_input_order(repository):
    fake = SparseTriton()
    texts = [f"t{k}" for k in range(5)]
    with fake_app(repository, fake) as client:
        reply = client.post("/embed_sparse", json={"inputs": texts})  # no model: the sparse one
        assert reply.status_code == 200, reply.text
        expected = [
            [{"index": k, "value": 0.5}] + ([{"index": 1000 + k, "value": 1.5}] if k % 2 else [])
            for k in range(5)
        ]
        assert reply.json() == expected
        assert len(fake.inputs) == 3  # max_batch_size 2
        sent = fake.inputs[0]
        assert set(sent) == {contract.TEXT_INPUT}  # the model's own truncate, no prompt

        body = {"inputs": "t3", "truncate": False, "prompt_name": "query", "model": "splade"}
        one = client.post("/embed_sparse", json=body)
        assert one.status_code == 200 and one.json() == [expected[3]]
    sent = fake.inputs[-1]
    assert sent[contract.TRUNCATE].tolist() == [[False]]
    assert sent[contract.PROMPT_NAME].tolist() == [[b"query"]]


def test_dense_and_sparse_models_answer_only_their_endpoints(repository):
    fake = SparseTriton()
    with fake_app(repository, fake) as client:
        # Without `model`, each endpoint takes the only model of its kind of vectors.
        assert client.post("/v1/embeddings", json={"input": ["a"]}).status_code == 200
        assert client.post("/embed", json={"inputs": ["a"]}).status_code == 200
        refused = {
            "/embed_sparse": ({"inputs": ["a"], "model": "embedding"}, "/v1/embeddings or /embed"),
            "/embed": ({"inputs": ["a"], "model": "splade"}, "/embed_sparse"),
            "/v1/embeddings": ({"input": ["a"], "model": "splade"}, "/embed_sparse"),
        }
        for path, (body, hint) in refused.items():
            reply = client.post(path, json=body)
            assert reply.status_code == 400, (path, reply.text)
            error = reply.json()["error"]
            assert error["param"] == "model" and hint in error["message"], error
    assert fake.inputs == []


def test_a_model_error_names_its_field(repository):
    message = "'prompt_name' 'passage' is not one of this model's prompts: 'document', 'query'"
    _, text = response_error(InputError(message))
    error = InferenceServerException(msg=text, status="StatusCode.INVALID_ARGUMENT")
    fake = SparseTriton(from_triton_exception(error))
    with fake_app(repository, fake) as client:
        reply = client.post("/embed_sparse", json={"inputs": ["t1"], "prompt_name": "passage"})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "prompt_name"
        assert "'document', 'query'" in reply.json()["error"]["message"]
        left = client.post("/embed_sparse", json={"inputs": ["t1"], "truncation_direction": "Left"})
        assert left.status_code == 400
        assert left.json()["error"]["param"] == "truncation_direction"
