"""The Messages API translation without a server (openai_frontend/anthropic/): requests -> chat
requests, chat chunks -> Anthropic's stream events (parsed by the `anthropic` SDK's own
accumulator), errors in Anthropic's shape."""

from __future__ import annotations

import asyncio

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from backend_lib.contract import ErrorCode
from openai_frontend.anthropic import errors, translate
from openai_frontend.anthropic.protocol import CountTokensRequest, MessagesRequest
from openai_frontend.errors import APIError, from_code

HEADER = {"id": "chatcmpl-abc", "model": "llm", "object": "chat.completion.chunk"}


def _request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "llm", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_turns_become_chat_messages():
    body = _request(
        system=[{"type": "text", "text": "A street. "}, {"type": "text", "text": "Night."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me see."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "V"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        tools=[{"name": "w", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        top_k=5,
        metadata={"user_id": "u"},
    )
    chat = translate.chat_request(body)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "A street. Night."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "V"}'},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "thanks"},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == {"type": "object"}
    assert (chat.max_tokens, chat.stop, chat.top_k, chat.stream) == (8, ["\n\n"], 5, False)


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
    ],
)
def test_tool_choice(choice, chat):
    tools = [{"name": "w", "input_schema": {"type": "object"}}]
    assert translate.chat_request(_request(tools=tools, tool_choice=choice)).tool_choice == chat


def test_output_config_format_is_a_json_schema_response_format():
    schema = {"type": "object"}
    chat = translate.chat_request(
        _request(output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == schema
    with pytest.raises(APIError) as raised:
        translate.chat_request(_request(output_config={"format": {"type": "xml"}}))
    assert raised.value.param == "output_config.format"


def test_count_tokens_body_has_no_sampling():
    body = CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert translate.chat_request(body).max_tokens is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"name": "s", "type": "bash_20250124", "input_schema": {}}]}, "tools.0.type"),
        (
            {"tools": [{"name": "w", "input_schema": {}}], "tool_choice": {"type": "tool"}},
            "tool_choice",
        ),
    ],
)
def test_bad_requests_name_the_field(fields, param):
    with pytest.raises(APIError) as raised:
        translate.chat_request(_request(**fields))
    assert raised.value.status == 400 and raised.value.param == param


def test_message_of_a_chat_completion():
    completion = {
        "id": "chatcmpl-abc",
        "model": "llm",
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"id": "call_x", "function": {"name": "w", "arguments": '{"a": 1}'}},
                        {"id": "call_y", "function": {"name": "w", "arguments": '{"a": '}},
                    ],
                },
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13},
    }
    assert translate.message(completion) == {
        "id": "msg_abc",
        "type": "message",
        "role": "assistant",
        "model": "llm",
        "content": [
            {"type": "tool_use", "id": "toolu_x", "name": "w", "input": {"a": 1}},
            {"type": "tool_use", "id": "toolu_y", "name": "w", "input": {}},  # cut
        ],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 5,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 8,
        },
    }


@pytest.mark.parametrize(
    ("finish", "stop", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 7, ("end_turn", None)),  # a stop token id
        ("stop", "\n\n", ("stop_sequence", "\n\n")),
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
    ],
)
def test_stop_reason(finish, stop, expected):
    assert translate.stop_reason(finish, stop) == expected


def _events(chunks: list[dict], fail: Exception | None = None) -> list[dict]:
    async def source():
        for chunk in chunks:
            yield {**HEADER, **chunk}
        if fail is not None:
            raise fail

    async def collect():
        return [event async for event in translate.stream_events(source())]

    return asyncio.run(collect())


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def _accumulated(events: list[dict]):
    snapshot, buffers = None, {}
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


def test_text_then_tool_call_stream_events():
    events = _events(
        [
            {
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                "usage": _usage(7, 0),
            },
            {"choices": [{"index": 0, "delta": {"content": "Hark"}}], "usage": _usage(7, 1)},
            {"choices": [{"index": 0, "delta": {"content": ", hark."}}], "usage": _usage(7, 3)},
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call_x",
                                    "type": "function",
                                    "function": {"name": "w", "arguments": ""},
                                }
                            ]
                        },
                    }
                ],
                "usage": _usage(7, 4),
            },
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Ve'}}]
                        },
                    }
                ],
                "usage": _usage(7, 6),
            },
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [{"index": 0, "function": {"arguments": 'rona"}'}}]
                        },
                        "finish_reason": "tool_calls",
                        "stop_reason": None,
                    }
                ],
                "usage": _usage(7, 9),
            },
            {"choices": [], "usage": _usage(7, 9)},
        ]
    )
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"] == {
        "input_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 9},
    }
    message = _accumulated(events)
    assert message.content[0].text == "Hark, hark."
    assert (message.content[1].id, message.content[1].input) == ("toolu_x", {"city": "Verona"})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 9


def test_an_error_after_the_stream_began_is_an_anthropic_error_event():
    start = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = _events([start], fail=from_code(ErrorCode.UNAVAILABLE, "unloaded"))
    assert events[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "unloaded"},
    }
    crashed = _events([start], fail=RuntimeError("boom"))
    assert crashed[-1]["error"] == {"type": "api_error", "message": "RuntimeError: boom"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (422, "invalid_request_error"),
        (502, "api_error"),
    ],
)
def test_error_types_by_status(status, kind):
    assert errors.body(APIError(status, "m", "x")) == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
    }


def test_only_the_messages_paths_get_anthropic_errors():
    assert errors.serves("/v1/messages") and errors.serves("/v1/messages/count_tokens")
    assert not errors.serves("/v1/messagesx") and not errors.serves("/v1/chat/completions")


def test_image_blocks_become_chat_image_parts():
    data = "iVBORw0KGgo="
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = _request(
        messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What?"}, url_image]}
        ]
    )
    (message,) = translate.chat_request(body).messages
    assert message.image_urls() == [f"data:image/png;base64,{data}", "https://example.com/a.png"]
    assert message.template_content() == [
        {"type": "image"},
        {"type": "text", "text": "What?"},
        {"type": "image"},
    ]
    missing = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
    with pytest.raises(APIError, match="needs `media_type` and `data`"):
        translate.chat_request(_request(messages=[{"role": "user", "content": [missing]}]))
    with pytest.raises(
        APIError, match="not supported in a assistant turn|not supported in an assistant"
    ):
        translate.chat_request(_request(messages=[{"role": "assistant", "content": [image]}]))
