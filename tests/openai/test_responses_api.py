"""`/v1/responses` through the `openai` SDK's `client.responses`, checked against chat completions
of the equivalent messages (the Responses API is a translation over chat): greedy text, streamed
events, `previous_response_id`, `text.format`, forced function calls, the store (GET, DELETE, its
bound) and bad requests answered in OpenAI's error shape while a good request is served."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.openai.frontend_helpers import REPO_ROOT
from tests.openai.references import CHAT_MESSAGES

pytestmark = pytest.mark.e2e

INSTRUCTIONS, QUESTION = CHAT_MESSAGES[0]["content"], CHAT_MESSAGES[1]["content"]
GREEDY = {"temperature": 0, "max_output_tokens": 24}
CHAT_GREEDY = {"temperature": 0, "max_tokens": 24}
WHO = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "armed": {"type": "boolean"}},
    "required": ["name", "armed"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def chat_text(sdk: openai.OpenAI, messages: list[dict], **params) -> tuple[str, object]:
    reply = sdk.chat.completions.create(model="llm", messages=messages, **(CHAT_GREEDY | params))
    return reply.choices[0].message.content, reply


def test_greedy_response_equals_the_chat_completion(sdk):
    response = sdk.responses.create(
        model="llm", instructions=INSTRUCTIONS, input=QUESTION, **GREEDY
    )
    expected, reply = chat_text(sdk, CHAT_MESSAGES)
    assert isinstance(response, Response) and response.id.startswith("resp_")
    assert response.object == "response" and response.model == "llm:1"  # the serving version
    assert response.output_text == expected
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert reply.choices[0].finish_reason == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.usage.output_tokens == reply.usage.completion_tokens == 24
    assert response.usage.total_tokens == reply.usage.total_tokens
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 24
    # message items with text parts, as an SDK user writes a conversation
    parts = sdk.responses.create(
        model="llm",
        input=[
            {"role": "developer", "content": INSTRUCTIONS},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            },
        ],
        **GREEDY,
    )
    assert parts.output_text == expected


def test_stream_events_join_to_the_whole_response(sdk):
    whole = sdk.responses.create(model="llm", instructions=INSTRUCTIONS, input=QUESTION, **GREEDY)
    events = list(
        sdk.responses.create(
            model="llm", instructions=INSTRUCTIONS, input=QUESTION, stream=True, **GREEDY
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text
    assert events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 24
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert sdk.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(sdk):
    first = sdk.responses.create(model="llm", instructions=INSTRUCTIONS, input=QUESTION, **GREEDY)
    second = sdk.responses.create(
        model="llm", input="Speak again.", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    # The prompt is the first turn's input and output, then the new input; instructions are not
    # carried over (OpenAI's rule).
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Speak again."},
    ]
    expected, reply = chat_text(sdk, messages)
    assert second.output_text == expected
    assert second.usage.input_tokens == reply.usage.prompt_tokens
    third = sdk.responses.create(
        model="llm",
        instructions=INSTRUCTIONS,
        input="And again.",
        previous_response_id=second.id,
        **GREEDY,
    )
    expected, _ = chat_text(
        sdk,
        [
            CHAT_MESSAGES[0],
            *messages,
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "And again."},
        ],
    )
    assert third.output_text == expected


def test_json_schema_format_output_validates(sdk):
    response = sdk.responses.create(
        model="llm",
        instructions=INSTRUCTIONS,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "who", "schema": WHO, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WHO)
    assert response.text.format.type == "json_schema" and response.text.format.name == "who"
    loose = sdk.responses.create(
        model="llm",
        input=QUESTION,
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=60,
    )
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)


def test_get_and_delete(sdk):
    made = sdk.responses.create(model="llm", input=QUESTION, **GREEDY)
    fetched = sdk.responses.retrieve(made.id)
    assert fetched.model_dump() == made.model_dump()
    sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(made.id)
    unstored = sdk.responses.create(model="llm", input=QUESTION, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


def test_forced_function_call_and_its_output_sent_back(sdk):
    response = sdk.responses.create(
        model="llm",
        input="Weather in Verona?",
        tools=[TOOL],
        tool_choice=FORCED,
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tools[0].name == "get_weather" and response.tool_choice.name == "get_weather"

    events = list(
        sdk.responses.create(
            model="llm",
            input="Weather in Verona?",
            tools=[TOOL],
            tool_choice=FORCED,
            temperature=0,
            max_output_tokens=60,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments

    # An agent sends the result back: the chat template sees the call and the tool's answer.
    answer = sdk.responses.create(
        model="llm",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain."}],
        **GREEDY,
    )
    expected, _ = chat_text(
        sdk,
        [
            {"role": "user", "content": "Weather in Verona?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Rain."},
        ],
    )
    assert answer.output_text == expected


BAD_REQUESTS = [
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input.0.type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input.0.content.0.image_url",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0.type"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"}, "tools.0.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "ghost"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
        "text.format",
    ),
    ({"background": True}, "background"),
    ({"temperature": 5}, "temperature"),
]


def test_bad_requests_get_400s_while_a_good_one_is_served(frontend, sdk):
    good = {"model": "llm", "instructions": INSTRUCTIONS, "input": QUESTION, **GREEDY}
    expected = sdk.responses.create(**good).output_text

    def post(fields: dict) -> httpx.Response:
        with httpx.Client(base_url=frontend.url, timeout=120) as http:
            return http.post("/v1/responses", json={"model": "llm", "input": "hi", **fields})

    with ThreadPoolExecutor(4) as pool:
        served = pool.submit(
            lambda: [e for e in sdk.responses.create(**good, stream=True)][-1].response
        )
        replies = list(pool.map(post, [fields for fields, _ in BAD_REQUESTS]))
        assert served.result().output_text == expected
    for (fields, param), reply in zip(BAD_REQUESTS, replies, strict=True):
        assert reply.status_code == 400, (fields, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and error["param"] == param, (fields, error)
        assert error["message"]
    missing = replies[3].json()["error"]
    assert missing["code"] == "previous_response_not_found"
    assert missing["message"] == "Previous response with id 'resp_nope' not found."


def test_store_keeps_the_most_recent_responses(server, make_frontend):
    small = make_frontend(
        server.grpc_url, REPO_ROOT / "model_repository", "--responses-store-size", "2"
    )
    sdk = openai.OpenAI(base_url=small.base_url, api_key="unused", max_retries=0)
    ids = [sdk.responses.create(model="llm", input=QUESTION, max_output_tokens=2).id for _ in "abc"]
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(ids[0])
    assert [sdk.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="llm", input="x", previous_response_id=ids[0])
    assert caught.value.code == "previous_response_not_found"
