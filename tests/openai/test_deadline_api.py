"""The client's timeout as the llm's deadline at the frontend (openai_frontend/deadline.py), over a
stand-in for tritonserver (no server): `x-request-timeout` (seconds) reaches the llm as
`deadline_ms` from chat, completions, Responses and Messages; a malformed one is a 400 naming the
header; the llm's `[deadline_exceeded]` error is a 504 in each API's error shape (the `openai` and
`anthropic` SDKs raise on it) and its `[queue_timeout]` a 503 with Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from backend_lib import contract
from backend_lib.contract import ErrorCode, encode_error
from openai_frontend.errors import from_stream_error
from tests.openai.scripted_triton_helpers import (
    ScriptedTriton,
    scripted_client,
    scripted_sdk,
    write_scripted_repository,
)

FACTS = {"llm": contract.ModelFacts(1024)}
MESSAGES = [{"role": "user", "content": "Who goes there?"}]
EXPIRED = "deadline exceeded: the request took 2004 ms, past its deadline of 2000 ms, while running"


class FailingTriton(ScriptedTriton):
    """Answers every generate with the model error `error` (as the gRPC stream delivers it)."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__(FACTS)
        self.error = error

    async def generate(self, model, prompt, sampling_parameters, **kwargs):
        if self.error is not None:
            self.requests.append({"model": model, "prompt": prompt, "params": sampling_parameters})
            raise from_stream_error(self.error)
        async for response in super().generate(model, prompt, sampling_parameters, **kwargs):
            yield response


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_scripted_repository(tmp_path_factory.mktemp("deadline-repo"), ["llm"])


@pytest.fixture
def triton() -> FailingTriton:
    return FailingTriton()


@pytest.fixture
def client(repository, triton) -> Iterator[TestClient]:
    with scripted_client(repository, triton) as client:
        yield client


def test_the_header_becomes_deadline_ms_on_every_generating_api(client, triton):
    headers = {"x-request-timeout": "2.5"}
    sdk = scripted_sdk(client)
    sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4, extra_headers=headers)
    sdk.completions.create(model="llm", prompt="ROMEO:", max_tokens=4, extra_headers=headers)
    sdk.responses.create(model="llm", input="Who?", max_output_tokens=4, extra_headers=headers)
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )
    claude.messages.create(model="llm", messages=MESSAGES, max_tokens=4, extra_headers=headers)
    assert [r["params"].get("deadline_ms") for r in triton.requests] == [2500.0] * 4
    triton.requests.clear()
    sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4)
    assert "deadline_ms" not in triton.requests[0]["params"]  # no header, no deadline


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_a_malformed_header_is_a_400_naming_it(client, triton, value):
    response = client.post(
        "/v1/chat/completions",
        json={"model": "llm", "messages": MESSAGES, "max_tokens": 4},
        headers={"x-request-timeout": value},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-request-timeout"
    assert triton.requests == []
    # Only the generating APIs read it: listing models ignores it.
    assert client.get("/v1/models", headers={"x-request-timeout": value}).status_code == 200


def test_a_deadline_exceeded_is_a_504_in_each_shape(client, triton):
    triton.error = encode_error(ErrorCode.DEADLINE_EXCEEDED, EXPIRED)
    with pytest.raises(openai.InternalServerError) as error:
        scripted_sdk(client).chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4)
    assert error.value.status_code == 504
    assert error.value.body["type"] == "timeout_error" and "2004 ms" in error.value.body["message"]
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )
    with pytest.raises(anthropic.APIStatusError) as error:
        claude.messages.create(model="llm", messages=MESSAGES, max_tokens=4)
    assert error.value.status_code == 504
    assert error.value.body == {
        "type": "error",
        "error": {"type": "timeout_error", "message": EXPIRED},
    }


def test_a_queue_timeout_is_a_503_with_retry_after(client, triton):
    triton.error = encode_error(ErrorCode.QUEUE_TIMEOUT, "queue wait limit exceeded")
    response = client.post(
        "/v1/chat/completions", json={"model": "llm", "messages": MESSAGES, "max_tokens": 4}
    )
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable_error"
