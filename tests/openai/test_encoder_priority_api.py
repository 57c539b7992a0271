"""Priority and the client's timeout on the encoder APIs, against a stand-in for tritonserver that
records what it is sent: vLLM's `priority` on /v1/embeddings (the `openai` SDK's `extra_body`),
/v1/rerank and /v1/score reaches the model as its INT32 `priority` input (one value per row; 0 is
not sent), an `x-request-timeout` header as the Triton request's timeout in microseconds, and a
priority out of INT32 or not an integer is a 400 naming the field, with nothing sent."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from backend_lib import contract
from tests.openai.fake_triton_helpers import FakeTriton, fake_app
from tooling.checkpoints import MINILM_DIR
from tooling.repository import ModelSpec, write_model

EMBEDDING = ModelSpec("embedding", "embedding", {"model": str(MINILM_DIR)})
RERANK = ModelSpec("rerank", "rerank", {"model": str(MINILM_DIR)})


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for spec in (EMBEDDING, RERANK):
        write_model(spec, tmp_path)
    return tmp_path


@pytest.fixture
def fake() -> FakeTriton:
    return FakeTriton([EMBEDDING, RERANK], {})


def sent_priorities(fake: FakeTriton) -> list:
    return [
        None
        if contract.PRIORITY not in call["inputs"]
        else call["inputs"][contract.PRIORITY].tolist()
        for call in fake.inferred
    ]


def test_the_priority_and_timeout_reach_every_encoder_request(repository, fake):
    with fake_app(repository, fake) as client:
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
        )
        sdk.embeddings.create(
            model="embedding",
            input=["a", "b"],
            extra_body={"priority": -2},
            extra_headers={"x-request-timeout": "1.5"},
        )
        sdk.embeddings.create(model="embedding", input=["c"])
        reply = client.post(
            "/v1/rerank",
            json={"model": "rerank", "query": "q", "documents": ["x", "y"], "priority": 3},
        )
        assert reply.status_code == 200, reply.text
        reply = client.post(
            "/v1/score", json={"model": "rerank", "text_1": "q", "text_2": ["x"], "priority": 1}
        )
        assert reply.status_code == 200, reply.text
    assert sent_priorities(fake) == [[[-2], [-2]], None, [[3], [3]], [[1]]]
    assert [call["timeout_us"] for call in fake.inferred] == [1_500_000, None, None, None]


@pytest.mark.parametrize("bad", [1.5, "high", 2**31])
def test_a_bad_priority_is_a_400_naming_it(repository, fake, bad):
    with fake_app(repository, fake) as client:
        for path, body in [
            ("/v1/embeddings", {"model": "embedding", "input": "a"}),
            ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["x"]}),
            ("/v1/score", {"model": "rerank", "text_1": "q", "text_2": "x"}),
        ]:
            reply = client.post(path, json={**body, "priority": bad})
            assert reply.status_code == 400, (path, reply.text)
            assert reply.json()["error"]["param"] == "priority"
    assert fake.inferred == []
