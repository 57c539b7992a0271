"""`tool_choice` "auto" and "none" and reasoning through the chat route, against a stand-in for
tritonserver whose llm "writes" fixed texts (no server): the parsers the llm publishes in its facts
turn the text into `tool_calls` and `reasoning_content`, whole and streamed (the `openai` SDK reads
both); plain text stays content; an llm without a parser refuses "auto" with a 400 naming
`tool_choice`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from tests.openai.tool_parser_helpers import join_chat_deltas, sse_deltas
from tooling.repository import REPO_ROOT

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Verona?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona"}}</tool_call>'
SECOND = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
PARSERS = {
    "hermes": contract.ModelFacts(1024, (), "hermes"),
    "thinking": contract.ModelFacts(1024, (), "hermes", "qwen3"),
    "r1": contract.ModelFacts(1024, (), None, "deepseek_r1"),
    "mistral": contract.ModelFacts(1024, (), "mistral"),
    "plain": contract.ModelFacts(1024),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_scripted_repository(tmp_path_factory.mktemp("parsers-repo"), list(PARSERS))


@pytest.fixture
def triton() -> ScriptedTriton:
    return ScriptedTriton(PARSERS, piece=3)


@pytest.fixture
def client(repository: Path, triton: ScriptedTriton) -> Iterator[TestClient]:
    with scripted_client(repository, triton) as test_client:
        yield test_client


@pytest.fixture
def sdk(client: TestClient) -> openai.OpenAI:
    return scripted_sdk(client)


def _chunks(client: TestClient, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _reasons(chunks: list[dict[str, Any]], index: int = 0) -> list[str]:
    return [
        c["finish_reason"]
        for chunk in chunks
        for c in chunk["choices"]
        if c["index"] == index and c["finish_reason"]
    ]


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_auto_finds_the_call(sdk, triton, tool_choice):
    triton.outputs = [f"Let me see.\n{CALL}"]
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    reply = sdk.chat.completions.create(model="hermes", messages=MESSAGES, tools=TOOLS, **extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me see.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Verona"},
    )
    assert "structured_outputs" not in triton.requests[0]["params"]  # generation is free


def test_auto_streams_content_then_call_deltas(client, triton):
    triton.outputs = [f"Let me see.\n{CALL}\n{SECOND}"]
    chunks = _chunks(client, model="hermes", messages=MESSAGES, tools=TOOLS)
    deltas = sse_deltas(chunks)
    assert deltas[0] == {"role": "assistant", "content": ""}
    message = join_chat_deltas(deltas)
    assert message["content"] == "Let me see.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Verona"}),
        ("get_time", {}),
    ]
    headers = [d["tool_calls"][0] for d in deltas if "id" in (d.get("tool_calls") or [{}])[0]]
    assert [h["function"] for h in headers] == [
        {"name": "get_weather", "arguments": ""},
        {"name": "get_time", "arguments": ""},
    ]
    assert _reasons(chunks) == ["tool_calls"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_sdk_stream_helper_joins_the_calls(sdk, triton):
    triton.outputs = [f"{CALL}{SECOND}"]
    with sdk.chat.completions.stream(model="hermes", messages=MESSAGES, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Verona"}


@pytest.mark.parametrize("stream", [False, True])
def test_plain_text_stays_content(client, sdk, triton, stream):
    triton.outputs = ["Thou art <tool of fortune>, and I <tool_cal"]
    if stream:
        chunks = _chunks(client, model="hermes", messages=MESSAGES, tools=TOOLS)
        message = join_chat_deltas(sse_deltas(chunks))
        assert message["content"] == triton.outputs[0] and message["tool_calls"] == []
        assert _reasons(chunks) == ["stop"]
        return
    reply = sdk.chat.completions.create(model="hermes", messages=MESSAGES, tools=TOOLS)
    assert reply.choices[0].message.content == triton.outputs[0]
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_none_leaves_the_call_text_as_content(client, sdk, triton, stream):
    triton.outputs = [CALL]
    body = {"model": "hermes", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    if stream:
        chunks = _chunks(client, **body)
        message = join_chat_deltas(sse_deltas(chunks))
        assert message["content"] == CALL and message["tool_calls"] == []
        assert _reasons(chunks) == ["stop"]
    else:
        reply = sdk.chat.completions.create(**body)
        assert reply.choices[0].message.content == CALL
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].finish_reason == "stop"
    assert "structured_outputs" not in triton.requests[0]["params"]


def test_a_call_cut_by_max_tokens_is_content_and_length(sdk, triton):
    triton.outputs, triton.reason = [CALL[:30]], "length"
    reply = sdk.chat.completions.create(model="hermes", messages=MESSAGES, tools=TOOLS)
    assert reply.choices[0].message.content == CALL[:30]
    assert reply.choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_answers_the_first_call(sdk, triton):
    triton.outputs = [CALL + SECOND]
    reply = sdk.chat.completions.create(
        model="hermes", messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False
    )
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]


def test_every_choice_is_parsed_on_its_own(client, triton):
    triton.outputs = [CALL, "No call here."]
    chunks = _chunks(client, model="hermes", messages=MESSAGES, tools=TOOLS, n=2)
    first, second = (join_chat_deltas(sse_deltas(chunks, i)) for i in (0, 1))
    assert [c["name"] for c in first["tool_calls"]] == ["get_weather"] and not first["content"]
    assert second == {"content": "No call here.", "reasoning_content": "", "tool_calls": []}
    assert (_reasons(chunks, 0), _reasons(chunks, 1)) == (["tool_calls"], ["stop"])


def test_auto_without_a_parser_is_a_400_naming_tool_choice(client, sdk, triton):
    reply = client.post(
        "/v1/chat/completions", json={"model": "plain", "messages": MESSAGES, "tools": TOOLS}
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tool_choice"
    assert "tool_call_parser" in error["message"] and "`plain`" in error["message"]
    assert triton.requests == []
    # The same model answers "none" and forced calls, and another model answers "auto".
    none = sdk.chat.completions.create(
        model="plain", messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].message.content == "Good morrow."
    assert sdk.chat.completions.create(model="hermes", messages=MESSAGES, tools=TOOLS).choices


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_calls(client, sdk, triton, stream):
    triton.outputs = [f"<think>\nThe user asks of Verona.\n</think>\n\n{CALL}"]
    if stream:
        chunks = _chunks(client, model="thinking", messages=MESSAGES, tools=TOOLS)
        message = join_chat_deltas(sse_deltas(chunks))
        assert _reasons(chunks) == ["tool_calls"]
        calls = [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]]
    else:
        reply = sdk.chat.completions.create(model="thinking", messages=MESSAGES, tools=TOOLS)
        message = reply.choices[0].message.model_dump()
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in reply.choices[0].message.tool_calls
        ]
    assert message["reasoning_content"] == "\nThe user asks of Verona.\n"
    assert not message["content"]
    assert calls == [("get_weather", {"city": "Verona"})]


def test_reasoning_without_tools(client, sdk, triton):
    triton.outputs = ["Hmm, a rose.</think>\n\nBy any other name."]
    reply = client.post("/v1/chat/completions", json={"model": "r1", "messages": MESSAGES}).json()
    message = reply["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "\n\nBy any other name.",
        "reasoning_content": "Hmm, a rose.",
    }
    chunks = _chunks(client, model="r1", messages=MESSAGES)
    deltas = sse_deltas(chunks)
    assert join_chat_deltas(deltas)["reasoning_content"] == "Hmm, a rose."
    assert all(len(set(d) - {"role"}) <= 1 for d in deltas)  # one kind of field per delta


def test_a_constrained_answer_is_not_reasoning(client, triton):
    triton.outputs = ['{"who": "Romeo"}']
    body = {"model": "r1", "messages": MESSAGES, "response_format": {"type": "json_object"}}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == '{"who": "Romeo"}' and message["reasoning_content"] is None


def test_mistral_keeps_special_tokens(sdk, triton):
    triton.outputs = ['[TOOL_CALLS][{"name": "get_time", "arguments": {}}]']
    reply = sdk.chat.completions.create(model="mistral", messages=MESSAGES, tools=TOOLS)
    assert reply.choices[0].message.tool_calls[0].function.name == "get_time"
    assert triton.requests[0]["params"]["skip_special_tokens"] is False
    sdk.chat.completions.create(model="mistral", messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert "skip_special_tokens" not in triton.requests[1]["params"]


def test_tool_results_go_back_to_the_template(sdk, triton):
    triton.outputs = ["Sunny."]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 20 C"},
    ]
    reply = sdk.chat.completions.create(model="hermes", messages=history, tools=TOOLS)
    assert reply.choices[0].message.content == "Sunny." and reply.choices[0].finish_reason == "stop"
    assert "sunny, 20 C" in triton.requests[0]["prompt"]
