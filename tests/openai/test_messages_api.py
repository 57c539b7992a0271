"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK: answers equal chat completions of the same messages, streams equal whole answers,
stop sequences, forced tools and tool results, token counts equal to the engine's, and errors in
Anthropic's shape (the OpenAI endpoints keep OpenAI's)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.openai.conftest import in_process_client
from tests.openai.references import API_KEY, CHAT_MESSAGES, sse_events

pytestmark = pytest.mark.e2e
SAMPLING = ("temperature", "top_p", "top_k")
SYSTEM, QUESTION = CHAT_MESSAGES[0]["content"], CHAT_MESSAGES[1]["content"]
ASK = {
    "model": "llm",
    "system": SYSTEM,
    "messages": [{"role": "user", "content": QUESTION}],
    "max_tokens": 24,
    "temperature": 0,
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
FORCED = {**ASK, "max_tokens": 64, "tools": [WEATHER]}
FORCED["tool_choice"] = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def claude(frontend) -> anthropic.Anthropic:
    # The SDK appends /v1/messages to base_url: the frontend's root, without /v1.
    return anthropic.Anthropic(base_url=frontend.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def _sdk(fields: dict) -> dict:
    """`fields` as the SDK's arguments: it has no sampling arguments (temperature, top_p, top_k),
    so they go in `extra_body`."""
    sampling = {k: fields[k] for k in SAMPLING if k in fields}
    return {**{k: v for k, v in fields.items() if k not in SAMPLING}, "extra_body": sampling}


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_message_equals_the_chat_completion(claude, sdk):
    message = claude.messages.create(**_sdk(ASK))
    chat = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, temperature=0, max_tokens=24
    )
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.model == "llm:1" and message.type == "message"  # the version that served it
    assert [block.type for block in message.content] == ["text"]
    assert _text(message) == chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "length"
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert prompt_tokens(message) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens == 24


def test_stream_joined_equals_the_message(claude, client):
    whole = claude.messages.create(**_sdk(ASK))
    with claude.messages.stream(**_sdk(ASK)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert prompt_tokens(final) == prompt_tokens(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens == 24
    # The events on the wire: named, in Anthropic's order, message_start with the prompt's usage.
    with client.stream("POST", "/v1/messages", json={**ASK, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        names = [
            line[len("event: ") :] for line in response.iter_lines() if line.startswith("event: ")
        ]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_message_start_carries_the_prompt_tokens(client):
    with client.stream("POST", "/v1/messages", json={**ASK, "stream": True}) as response:
        data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    start, delta = data[0], next(d for d in data if d["type"] == "message_delta")
    assert start["message"]["content"] == [] and start["message"]["stop_reason"] is None
    assert start["message"]["usage"]["input_tokens"] > 0
    assert delta["usage"]["output_tokens"] == 24
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # What message_start reads: chat's chunks with vLLM's continuous_usage_stats.
    chat = {
        "model": "llm",
        "messages": CHAT_MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=chat) as response:
        chunks = [c for c in sse_events(response.iter_lines()) if c != "[DONE]"]
    usages = [c["usage"] for c in chunks]
    read = start["message"]["usage"]
    prompt = read["input_tokens"] + read["cache_read_input_tokens"]
    assert {k: usages[0][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
    }
    # The chat asked for the same prompt again: its blocks come from the prefix cache.
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [u["prompt_tokens"] for u in usages] == [prompt] * len(chunks)
    completed = [u["completion_tokens"] for u in usages]
    assert completed == sorted(completed) and completed[-1] == 24


def test_stop_sequences_give_stop_sequence(claude, sdk):
    full = _text(claude.messages.create(**_sdk(ASK)))
    stop = full.strip().split()[1]
    asked = {**ASK, "stop_sequences": ["#never#", stop]}
    message = claude.messages.create(**_sdk(asked))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == full[: full.index(stop)]
    with claude.messages.stream(**_sdk(asked)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert _text(final) == _text(message)
    # Chat carries the engine's stop_reason as vLLM does (the stop string that matched).
    chat = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, temperature=0, max_tokens=24, stop=[stop]
    )
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].model_extra["stop_reason"] == stop


def test_forced_tool_gives_a_tool_use_block(claude):
    message = claude.messages.create(**_sdk(FORCED))
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert isinstance(block, anthropic.types.ToolUseBlock)
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    assert isinstance(block.input["city"], str) and len(block.input["city"]) <= 8
    assert block.input["unit"] in ("celsius", "fahrenheit")
    with claude.messages.stream(**_sdk(FORCED)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == block.input and final.content[0].name == "get_weather"


def test_output_config_json_schema_constrains_the_text(claude):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
    }
    output_config = {"format": {"type": "json_schema", "schema": schema}}
    message = claude.messages.create(**_sdk({**ASK, "max_tokens": 48}), output_config=output_config)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


def test_any_tool_and_tool_result_round_trip(claude):
    one_call = {"type": "any", "disable_parallel_tool_use": True}  # chat's "required", one call
    first = claude.messages.create(**_sdk({**FORCED, "max_tokens": 96, "tool_choice": one_call}))
    [call] = first.content
    assert first.stop_reason == "tool_use" and call.name == "get_weather"
    follow_up = {
        **ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "none"},
        "messages": [
            *ASK["messages"],
            {
                "role": "assistant",
                "content": [block.model_dump(exclude_none=True) for block in first.content],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "Fair, with a west wind."}],
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
    }
    second = claude.messages.create(**_sdk(follow_up))
    assert second.stop_reason in ("end_turn", "max_tokens") and _text(second)
    counted = claude.messages.count_tokens(
        **{k: v for k, v in follow_up.items() if k in ("model", "system", "messages", "tools")},
        tool_choice={"type": "none"},
    )
    assert counted.input_tokens == prompt_tokens(second)
    assert prompt_tokens(second) > prompt_tokens(first)


def test_count_tokens_equals_the_engine_count(claude):
    fields = {k: FORCED[k] for k in ("model", "system", "messages", "tools", "tool_choice")}
    assert claude.messages.count_tokens(**fields).input_tokens == (
        prompt_tokens(claude.messages.create(**_sdk(FORCED)))
    )
    plain = {k: ASK[k] for k in ("model", "system", "messages")}
    assert claude.messages.count_tokens(**plain).input_tokens == (
        prompt_tokens(claude.messages.create(**_sdk(ASK)))
    )


def prompt_tokens(message) -> int:
    """The whole prompt of an answer: Anthropic counts the prefix-cache reads apart."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


BAD_REQUESTS = [
    ({k: v for k, v in ASK.items() if k != "max_tokens"}, 400, "max_tokens"),
    (
        {**ASK, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "source.type",
    ),
    ({**ASK, "messages": [{"role": "system", "content": "hi"}]}, 400, "role"),
    ({**ASK, "model": "no-such-model"}, 404, "no-such-model"),
    ({**ASK, "temperature": 1.5}, 400, "temperature"),
    ({**FORCED, "tool_choice": {"type": "tool", "name": "ghost"}}, 400, "ghost"),
    ({**ASK, "tools": [{**WEATHER, "type": "web_search_20250305"}]}, 400, "server tools"),
]


def test_bad_requests_get_anthropic_errors_while_a_good_one_succeeds(claude, client):
    with ThreadPoolExecutor(max_workers=4) as pool:
        good = pool.submit(claude.messages.create, **_sdk({**ASK, "max_tokens": 200}))
        answers = list(
            pool.map(lambda case: client.post("/v1/messages", json=case[0]), BAD_REQUESTS)
        )
        assert good.result().usage.output_tokens > 0
    for response, (_, status, mentioned) in zip(answers, BAD_REQUESTS, strict=True):
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert mentioned in _anthropic_error(response, status, kind)
    response = client.post("/v1/messages/count_tokens", json={"model": "llm", "messages": []})
    _anthropic_error(response, 400, "invalid_request_error")
    # The SDK raises its class for each status.
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(**_sdk({**ASK, "model": "no-such-model"}))
    assert raised.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(**_sdk({**ASK, "messages": [{"role": "user", "content": [image]}]}))
    # The OpenAI endpoints keep OpenAI's shape.
    chat = client.post("/v1/chat/completions", json={"model": "no-such-model", "messages": []})
    assert set(chat.json()) == {"error"} and chat.json()["error"]["type"] == "invalid_request_error"


def test_a_template_refusal_is_an_anthropic_400(server, tmp_path):
    template = tmp_path / "alternating.jinja"
    template.write_text(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    twice = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    # `with`: one event loop for the app's requests (its gRPC channel belongs to the first one).
    with in_process_client(server.grpc_url, chat_template=template) as app:
        message = _anthropic_error(
            app.post("/v1/messages", json={**ASK, "system": None, "messages": twice}),
            400,
            "invalid_request_error",
        )
        assert "roles must alternate" in message
        alternating = {**ASK, "system": None, "messages": twice[:1]}
        assert app.post("/v1/messages", json=alternating).status_code == 200


VERSION = {"anthropic-version": "2023-06-01"}


def test_without_a_key_messages_answer_an_anthropic_401(keyed_client):
    short = {**ASK, "max_tokens": 2}
    for headers in ({}, {"x-api-key": "sk-wrong"}, {"Authorization": "Bearer sk-wrong"}):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = keyed_client.post(path, json=short, headers={**headers, **VERSION})
            _anthropic_error(response, 401, "authentication_error")
    # The OpenAI endpoints' 401 keeps OpenAI's shape.
    refused = keyed_client.get("/v1/models", headers={"x-api-key": "sk-wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"


def test_x_api_key_and_bearer_are_both_accepted(server):
    # A key-protected app as keyed_client, on one event loop for its generate calls (`with`).
    with in_process_client(server.grpc_url, api_key=API_KEY) as keyed:
        for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
            response = keyed.post(
                "/v1/messages", json={**ASK, "max_tokens": 2}, headers={**headers, **VERSION}
            )
            assert response.status_code == 200, response.text
            assert response.json()["type"] == "message"
            counted = keyed.post(
                "/v1/messages/count_tokens",
                json={"model": "llm", "messages": ASK["messages"]},
                headers=headers,
            )
            assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        # x-api-key opens the OpenAI endpoints too.
        assert keyed.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
