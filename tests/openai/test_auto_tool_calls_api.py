"""`tool_choice` "auto" and "none" end to end: a tritonserver whose llm sets `tool_call_parser:
hermes` and `reasoning_parser: qwen3`, and the frontend in front of it. The Shakespeare model
cannot call tools by itself, so vLLM's `structured_outputs` regex makes it write a hermes call
(or plain text); the frontend then answers `tool_calls` through the `openai` SDK, streamed and
not, and one round of a LangChain tool-calling loop (call -> run the tool -> `role: tool` result
-> a text answer). Beside it: an llm without a parser (auto: a 400 naming `tool_choice`, while
concurrent good requests are answered) and one whose parser name is unknown (it fails to load,
the reason naming `tool_call_parser`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import tritonclient.http as httpclient
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.openai.frontend_helpers import Frontend, start_frontend, stop_frontend
from tests.server_helpers import start_server, stop_server
from tooling.repository import REPO_ROOT, ModelSpec, write_model
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e
SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona"}}</tool_call>'
CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Verona"\}\}</tool_call>'
THINKING_REGEX = r"<think>Verona, then\.</think>\n" + CALL_REGEX
ANSWER_REGEX = r"Fair and sunny in Verona\."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]


def _llm(name: str, **parameters: str) -> ModelSpec:
    settings = {
        "model": str(SHAKESPEARE),
        "dtype": "float32",
        "max_model_len": "512",
        "cpu_kv_cache_gb": "0.05",
        "max_num_seqs": "8",
        **parameters,
    }
    return ModelSpec(name, "llm", settings, max_batch_size=0)


@pytest.fixture(scope="module")
def parser_server(tmp_path_factory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("tool-parsers-repo")
    write_model(_llm("llm", tool_call_parser="hermes", reasoning_parser="qwen3"), repository)
    write_model(_llm("plain"), repository)
    write_model(_llm("broken", tool_call_parser="hermes2"), repository)
    server = start_server(repository, ["--exit-on-error=false"])
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def front(parser_server: TritonServer) -> Iterator[Frontend]:
    frontend = start_frontend(parser_server.grpc_url, parser_server.repository)
    yield frontend
    stop_frontend(frontend)


@pytest.fixture(scope="module")
def sdk(front: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)


def _regex(pattern: str) -> dict:
    """Body fields making the model write `pattern` (with room for it: the llm's default
    max_tokens is vLLM's 16)."""
    return {"structured_outputs": {"regex": pattern}, "max_tokens": 120}


def test_auto_answers_the_call(sdk):
    reply = sdk.chat.completions.create(
        model="llm",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        extra_body=_regex(CALL_REGEX),
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Verona"}


def test_auto_streams_the_call(sdk):
    stream = sdk.chat.completions.create(
        model="llm", messages=MESSAGES, tools=TOOLS, stream=True, extra_body=_regex(CALL_REGEX)
    )
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                if item.id is not None:
                    assert item.index not in calls and item.type == "function"
                    calls[item.index] = {"id": item.id, "name": item.function.name, "args": ""}
                calls[item.index]["args"] += item.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert content == "" and reasons == ["tool_calls"]
    (call,) = calls.values()
    assert call["name"] == "get_weather" and json.loads(call["args"]) == {"city": "Verona"}


def test_plain_text_stays_content(sdk):
    reply = sdk.chat.completions.create(
        model="llm", messages=MESSAGES, tools=TOOLS, extra_body=_regex(ANSWER_REGEX)
    )
    choice = reply.choices[0]
    assert choice.message.content == "Fair and sunny in Verona."
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_none_leaves_the_call_text_as_content(sdk, stream):
    request = dict(
        model="llm",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        extra_body=_regex(CALL_REGEX),
    )
    if stream:
        chunks = list(sdk.chat.completions.create(**request, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    else:
        choice = sdk.chat.completions.create(**request).choices[0]
        content = choice.message.content
        assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert content == CALL_TEXT


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_the_call(front, stream):
    body = {"model": "llm", "messages": MESSAGES, "tools": TOOLS, **_regex(THINKING_REGEX)}
    with httpx.Client(base_url=front.url, timeout=120) as http:
        if not stream:
            choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
            message = choice["message"]
            reasoning, content = message["reasoning_content"], message["content"]
            calls = [c["function"] for c in message["tool_calls"]]
        else:
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
            deltas = [e["choices"][0] for e in events if e["choices"]]
            reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
            content = "".join(d["delta"].get("content") or "" for d in deltas) or None
            calls = [
                item["function"]
                for d in deltas
                for item in d["delta"].get("tool_calls") or []
                if "id" in item
            ]
            arguments = "".join(
                item["function"].get("arguments", "")
                for d in deltas
                for item in d["delta"].get("tool_calls") or []
            )
            calls = [{"name": calls[0]["name"], "arguments": arguments}]
            choice = deltas[-1]
    assert reasoning == "Verona, then." and content is None
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Verona"})
    ]


def test_a_named_function_is_still_forced(sdk):
    reply = sdk.chat.completions.create(
        model="llm",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
    )
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    if choice.finish_reason == "tool_calls":
        assert isinstance(json.loads(call.function.arguments)["city"], str)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"In {city}: fair and sunny, 21 C."


def test_langchain_tool_calling_loop(front):
    def chat(pattern: str) -> ChatOpenAI:
        model = ChatOpenAI(
            base_url=front.base_url,
            api_key="unused",
            model="llm",
            max_retries=0,
            extra_body=_regex(pattern),
        )
        return model.bind_tools([get_weather])  # tool_choice unset: "auto"

    history = [HumanMessage("What is the weather in Verona?")]
    asked = chat(CALL_REGEX).invoke(history)
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Verona"}
    assert call["id"].startswith("call_")
    result = get_weather.invoke(call["args"])
    history += [asked, ToolMessage(result, tool_call_id=call["id"])]
    answer = chat(ANSWER_REGEX).invoke(history)
    assert answer.content == "Fair and sunny in Verona." and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] == "stop"


def test_auto_without_a_parser_is_refused_while_good_requests_run(front):
    def send(model: str) -> httpx.Response:
        body = {"model": model, "messages": MESSAGES, "tools": TOOLS, **_regex(CALL_REGEX)}
        with httpx.Client(base_url=front.url, timeout=120) as http:
            return http.post("/v1/chat/completions", json=body)

    models = ["llm", "plain"] * 4
    with ThreadPoolExecutor(len(models)) as pool:
        replies = list(pool.map(send, models))
    for model, reply in zip(models, replies, strict=True):
        if model == "plain":
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "tool_choice" and "tool_call_parser" in error["message"]
        else:
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_an_unknown_parser_fails_that_model_only(parser_server, sdk):
    client = httpclient.InferenceServerClient(parser_server.http_url)
    assert not client.is_model_ready("broken")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    reason = index["broken"].get("reason", "")
    assert "tool_call_parser" in reason and "hermes2" in reason, reason
    assert {m.id for m in sdk.models.list()} == {"llm", "plain", "llm:1", "plain:1"}
