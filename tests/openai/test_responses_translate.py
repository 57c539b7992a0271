"""The Responses API's translation over chat (openai_frontend/responses/) without a server: input
items -> chat messages, errors naming Responses' fields, chat's answers and chunks -> a response
object and stream events the `openai` SDK parses, the bounded store, and the routes in process
over a fake chat seam (routes/chat.py's `create` and `create_stream`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from backend_lib import contract
from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from openai_frontend.errors import APIError
from openai_frontend.responses import translate
from openai_frontend.responses.protocol import ResponsesRequest
from openai_frontend.responses.store import ResponseStore, StoredResponse
from openai_frontend.routes import chat
from tests.openai.scripted_triton_helpers import (
    ScriptedTriton,
    scripted_client,
    scripted_sdk,
    write_scripted_repository,
)
from tooling.tritonserver import free_port

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}


def body(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "llm", "input": "Who goes there?", **fields})


def chat_of(**fields: Any):
    request = body(**fields)
    return translate.chat_request(request, translate.input_items(request), request.stream)


def param_of(**fields: Any) -> str | None:
    with pytest.raises(APIError) as caught:
        chat_of(**fields)
    assert caught.value.status == 400
    return caught.value.param


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Speak in verse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
    ]
    request = chat_of(input=items, instructions="A street in Verona.")
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    assert messages == [
        {"role": "system", "content": "A street in Verona."},
        {"role": "developer", "content": "Speak in verse."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "call_1", **call}, {"id": "call_2", **call}],
        },
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "assistant", "tool_calls": [{"id": "call_3", **call}]},
    ]
    assert chat_of().messages[0].model_dump(exclude_none=True) == {
        "role": "user",
        "content": "Who goes there?",
    }


def test_settings_map_to_chat_fields():
    request = chat_of(
        max_output_tokens=7,
        temperature=0,
        top_p=0.5,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        stream=True,
        top_k=5,  # vLLM's extra
    )
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k) == (7, 0, 0.5, 5)
    assert request.tools[0].function.name == "get_weather"
    assert request.tools[0].function.parameters == WEATHER
    assert request.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert request.parallel_tool_calls is False
    assert request.response_format.json_schema.schema_ == WEATHER
    assert request.stream and request.include_usage()
    for fmt in ("text", "json_object"):
        assert chat_of(text={"format": {"type": fmt}}).response_format.type == fmt
    assert chat_of(tools=[TOOL], tool_choice="required").tool_choice == "required"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_requests_name_the_responses_field(fields, param):
    assert param_of(**fields) == param


def test_chat_params_are_renamed():
    assert translate.responses_param("response_format.json_schema") == "text.format"
    assert translate.responses_param("response_format") == "text.format"
    assert translate.responses_param("tools.2.function.parameters") == "tools.2.parameters"
    assert translate.responses_param("messages.3.content") == "input"
    assert translate.responses_param("max_tokens") == "max_output_tokens"
    assert translate.responses_param("tool_choice") == "tool_choice"
    assert translate.responses_param(None) is None


def completion(message: dict[str, Any], reason: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "llm",
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def test_chat_answer_as_a_response_the_sdk_parses():
    draft = translate.Draft(body(instructions="Be brief.", metadata={"k": "v"}))
    answer = translate.response_from_chat(
        draft, completion({"role": "assistant", "content": "Nay."})
    )
    parsed = Response.model_validate(answer)
    assert parsed.id.startswith("resp_") and parsed.object == "response"
    assert parsed.status == "completed" and parsed.output_text == "Nay."
    assert parsed.output[0].id.startswith("msg_") and parsed.output[0].role == "assistant"
    assert parsed.usage.input_tokens == 5 and parsed.usage.output_tokens == 3
    assert parsed.usage.total_tokens == 8
    assert parsed.instructions == "Be brief." and parsed.metadata == {"k": "v"}
    assert parsed.tool_choice == "auto" and parsed.tools == [] and parsed.text.format.type == "text"

    cut = translate.response_from_chat(
        translate.Draft(body()), completion({"role": "assistant", "content": "Na"}, "length")
    )
    parsed = Response.model_validate(cut)
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[0].status == "incomplete"

    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = translate.response_from_chat(
        translate.Draft(body(tools=[TOOL], tool_choice={"type": "function", "name": "f"})),
        completion({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"),
    )
    parsed = Response.model_validate(called)
    (item,) = parsed.output
    assert item.type == "function_call" and item.id.startswith("fc_")
    assert (item.call_id, item.name, item.arguments) == ("call_9", "f", "{}")
    assert parsed.tool_choice.name == "f" and parsed.tools[0].name == "get_weather"

    thought = translate.response_from_chat(
        translate.Draft(body()),
        completion({"role": "assistant", "content": "Ay.", "reasoning_content": "Hmm."}),
    )
    parsed = Response.model_validate(thought)
    assert [item.type for item in parsed.output] == ["reasoning", "message"]
    assert parsed.output[0].content[0].text == "Hmm." and parsed.output_text == "Ay."


def chunk(delta: dict[str, Any] | None, reason: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason}]
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "llm",
        "choices": choices,
        **extra,
    }


async def _iterate(items: list[Any]) -> AsyncIterator[dict[str, Any]]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


def run_stream(items: list[Any], request: ResponsesRequest | None = None):
    finished: list[dict[str, Any]] = []

    async def collect() -> list[dict[str, Any]]:
        draft = translate.Draft(request or body())
        return [e async for e in translate.stream_events(draft, _iterate(items), finished.append)]

    events = asyncio.run(collect())
    for event in events:
        EVENTS.validate_python(event)  # every event is one the SDK knows
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, finished


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_text_stream_events():
    events, finished = run_stream(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Who "}),
            chunk({"content": "goes?"}, "length"),
            chunk(None, usage=USAGE),
        ]
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert "".join(e["delta"] for e in events if e["type"].endswith("text.delta")) == "Who goes?"
    assert events[6]["text"] == "Who goes?"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Who goes?" and final.status == "incomplete"
    assert final.usage.output_tokens == 2
    assert finished == [events[-1]["response"]]


def test_tool_call_stream_events():
    header = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    events, _ = run_stream(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"content": "Let me look."}),
            chunk({"tool_calls": [header]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Verona"}'}}]}, "stop"),
            chunk(None, usage=USAGE),
        ],
        body(tools=[TOOL]),
    )
    kinds = [e["type"] for e in events]
    assert kinds[kinds.index("response.output_item.done") + 1 :] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Verona"}
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == "call_1" and final.output[1].status == "completed"


def test_empty_answer_is_an_empty_message_and_a_failure_is_reported():
    events, _ = run_stream([chunk({"role": "assistant", "content": ""}, "stop")])
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "" and len(final.output) == 1

    error = APIError(400, "bad schema", "invalid_request_error", "response_format")
    events, finished = run_stream([chunk({"content": "Ay"}), error])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["param"] == "text.format" and events[-2]["code"] == "invalid_prompt"
    assert events[-1]["response"]["status"] == "failed" and finished == []


def stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "output": [{"type": "message"}]}, [{"type": "x"}])


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(stored(name))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(stored("c"))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert store.get("a").conversation() == [{"type": "x"}, {"type": "message"}]
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(0)
    off.put(stored("a"))
    assert not off.enabled and off.get("a") is None


class FakeChat:
    """routes/chat.py's seam, answering canned text and recording the requests."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def create(self, request, state) -> dict[str, Any]:
        self.requests.append(request)
        return completion({"role": "assistant", "content": f"answer {len(self.requests)}"})

    async def create_stream(self, request, state) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        return _iterate([chunk({"content": "streamed"}, "stop"), chunk(None, usage=USAGE)])


@pytest.fixture
def fake(monkeypatch) -> FakeChat:
    fake = FakeChat()
    monkeypatch.setattr(chat, "create", fake.create)
    monkeypatch.setattr(chat, "create_stream", fake.create_stream)
    return fake


def app_client(**settings: Any) -> TestClient:
    config = FrontendConfig(triton_url=f"127.0.0.1:{free_port()}", **settings)
    return TestClient(create_app(config), raise_server_exceptions=False)


def test_routes_store_chain_get_and_delete(fake):
    with app_client() as http:
        first = http.post("/v1/responses", json={"model": "llm", "input": "Who goes there?"})
        assert first.status_code == 200, first.text
        first_id = first.json()["id"]
        second = http.post(
            "/v1/responses",
            json={"model": "llm", "input": "Speak.", "previous_response_id": first_id},
        ).json()
        assert second["previous_response_id"] == first_id
        texts = [(m.role, m.text()) for m in fake.requests[1].messages]
        assert texts == [
            ("user", "Who goes there?"),
            ("assistant", "answer 1"),
            ("user", "Speak."),
        ]
        assert http.get(f"/v1/responses/{first_id}").json() == first.json()
        assert http.delete(f"/v1/responses/{first_id}").json() == {
            "id": first_id,
            "object": "response.deleted",
            "deleted": True,
        }
        gone = http.get(f"/v1/responses/{first_id}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        assert http.delete(f"/v1/responses/{first_id}").status_code == 404

        missing = http.post("/v1/responses", json={"input": "x", "previous_response_id": first_id})
        assert missing.status_code == 400
        assert missing.json()["error"] == {
            "message": f"Previous response with id '{first_id}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
        unstored = http.post("/v1/responses", json={"input": "x", "store": False}).json()
        assert http.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_streamed_route_sends_named_events_and_stores_the_result(fake):
    with app_client() as http:
        with http.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in reply.iter_lines() if line]
        names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        payloads = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
        assert names == [p["type"] for p in payloads] and names[-1] == "response.completed"
        assert "[DONE]" not in "".join(lines)
        final = payloads[-1]["response"]
        assert http.get(f"/v1/responses/{final['id']}").json() == final


def test_store_size_setting_bounds_the_store(fake):
    with app_client(responses_store_size=2) as http:
        ids = [http.post("/v1/responses", json={"input": "x"}).json()["id"] for _ in range(3)]
        assert [http.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]
    with app_client(responses_store_size=0) as http:
        made = http.post("/v1/responses", json={"input": "x"}).json()
        assert http.get(f"/v1/responses/{made['id']}").status_code == 404


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "computer_call"}]}, "input.0.type"),
    ],
)
def test_refused_fields_are_400s_in_openai_shape(fake, fields, param):
    with app_client() as http:
        reply = http.post("/v1/responses", json={"input": "x", **fields})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fake.requests == []


# The real chat pipeline under the route, over a stand-in for tritonserver whose llms "write" a
# fixed text (as tests/openai/test_auto_tool_choice.py does for chat): tool_choice "auto" with
# the llm's hermes parser, and its qwen3 reasoning parser.

FACTS = {
    "hermes": contract.ModelFacts(1024, (), "hermes"),
    "thinking": contract.ModelFacts(1024, (), "hermes", "qwen3"),
    "plain": contract.ModelFacts(1024),
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona"}}</tool_call>'


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_scripted_repository(tmp_path_factory.mktemp("responses-repo"), list(FACTS))


@pytest.fixture
def triton() -> ScriptedTriton:
    return ScriptedTriton(FACTS, piece=4)


@pytest.fixture
def scripted(repository: Path, triton: ScriptedTriton) -> Iterator[TestClient]:
    with scripted_client(repository, triton) as http:
        yield http


@pytest.fixture(name="scripted_sdk")
def scripted_sdk_fixture(scripted: TestClient) -> openai.OpenAI:
    return scripted_sdk(scripted)


def _output(response) -> list[tuple[str, str]]:
    texts = []
    for item in response.output:
        if item.type == "function_call":
            texts.append((item.type, f"{item.name} {json.loads(item.arguments)}"))
        else:
            texts.append((item.type, item.content[0].text))
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_gives_function_call_items(scripted_sdk, triton, stream):
    triton.output = f"Let me see.\n{CALL}"
    request = {"model": "hermes", "input": "Weather in Verona?", "tools": [TOOL]}
    if stream:
        events = list(scripted_sdk.responses.create(**request, stream=True))
        response = events[-1].response
        arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert json.loads("".join(arguments)) == {"city": "Verona"}
    else:
        response = scripted_sdk.responses.create(**request)
    assert response.status == "completed" and response.tool_choice == "auto"
    assert _output(response) == [
        ("message", "Let me see.\n"),
        ("function_call", "get_weather {'city': 'Verona'}"),
    ]
    assert response.output[1].call_id.startswith("call_")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_becomes_a_reasoning_item(scripted_sdk, triton, stream):
    triton.output = f"<think>\nOf Verona.\n</think>\n\n{CALL}"
    request = {"model": "thinking", "input": "Weather in Verona?", "tools": [TOOL]}
    if stream:
        events = list(scripted_sdk.responses.create(**request, stream=True))
        response = events[-1].response
        thought = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(thought) == "\nOf Verona.\n"
    else:
        response = scripted_sdk.responses.create(**request)
    assert _output(response) == [
        ("reasoning", "\nOf Verona.\n"),
        ("function_call", "get_weather {'city': 'Verona'}"),
    ]
    # The reasoning item goes back with the conversation and is dropped from the prompt.
    triton.output = "Sunny."
    call = response.output[1]
    answer = scripted_sdk.responses.create(
        model="thinking",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}],
    )
    assert answer.output_text == "Sunny."
    assert "sunny, 20 C" in triton.prompts[-1] and "Of Verona" not in triton.prompts[-1]


def test_auto_without_a_parser_is_a_400_naming_tool_choice(scripted, triton):
    reply = scripted.post("/v1/responses", json={"model": "plain", "input": "hi", "tools": [TOOL]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
    assert triton.prompts == []


def test_input_image_parts_become_chat_image_parts():
    url = "data:image/png;base64,iVBORw0KGgo="
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is it?"},
                {"type": "input_image", "image_url": url, "detail": "auto"},
            ],
        }
    ]
    (message,) = chat_of(input=items).messages
    assert message.text() == "What is it?" and message.image_urls() == [url]
    assert message.template_content() == [
        {"type": "text", "text": "What is it?"},
        {"type": "image"},
    ]
    no_url = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
    assert param_of(input=no_url) == "input.0.content.0.image_url"
    tool_image = [
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_image", "image_url": url}],
        }
    ]
    assert param_of(input=tool_image) == "input.0.output.0.type"
