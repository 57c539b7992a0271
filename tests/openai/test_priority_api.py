"""vLLM's request `priority` through every generating API of the frontend, against a stand-in for
tritonserver that records what it is sent (no server): chat and completions (the `openai` SDK's
`extra_body`), the Responses API and Anthropic's Messages API (the `anthropic` SDK) each pass it
to the llm as `priority` in its sampling_parameters; 0 is not sent; a priority that is not an
integer is a 400 naming the field, and nothing is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from backend_lib import contract
from tests.openai.scripted_triton_helpers import (
    ScriptedTriton,
    scripted_client,
    scripted_sdk,
    write_scripted_repository,
)

FACTS = {"llm": contract.ModelFacts(1024)}
MESSAGES = [{"role": "user", "content": "Who goes there?"}]


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_scripted_repository(tmp_path_factory.mktemp("priority-repo"), ["llm"])


@pytest.fixture
def triton() -> ScriptedTriton:
    return ScriptedTriton(FACTS)


@pytest.fixture
def client(repository, triton) -> Iterator[TestClient]:
    with scripted_client(repository, triton) as client:
        yield client


def sent_priority(triton: ScriptedTriton) -> int | None:
    (request,) = triton.requests
    return request["params"].get("priority")


@pytest.mark.parametrize("priority", [-2, 0, 7])
def test_chat_and_completions_pass_the_priority(client, triton, priority):
    sdk = scripted_sdk(client)
    sdk.chat.completions.create(
        model="llm", messages=MESSAGES, max_tokens=4, extra_body={"priority": priority}
    )
    assert sent_priority(triton) == (priority or None)
    triton.requests.clear()
    sdk.completions.create(
        model="llm", prompt="ROMEO:", max_tokens=4, extra_body={"priority": priority}
    )
    assert sent_priority(triton) == (priority or None)


def test_responses_pass_the_priority(client, triton):
    scripted_sdk(client).responses.create(
        model="llm", input="Who goes there?", max_output_tokens=4, extra_body={"priority": 3}
    )
    assert sent_priority(triton) == 3


def test_messages_pass_the_priority(client, triton):
    sdk = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )
    sdk.messages.create(model="llm", messages=MESSAGES, max_tokens=4, extra_body={"priority": 2})
    assert sent_priority(triton) == 2


@pytest.mark.parametrize("bad", [1.5, "high", True])
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(client, triton, bad):
    sdk = scripted_sdk(client)
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(
            model="llm", messages=MESSAGES, max_tokens=4, extra_body={"priority": bad}
        )
    assert "priority" in str(error.value)
    response = client.post(
        "/v1/messages",
        json={"model": "llm", "messages": MESSAGES, "max_tokens": 4, "priority": bad},
    )
    assert response.status_code == 400 and "priority" in response.text
    assert triton.requests == []
