"""Forced tool calls through the frontend (`tool_choice` a named function or "required") with the
`openai` SDK, streamed and not, and LangChain's `with_structured_output(method="function_calling")`:
arguments parse and validate against the function's parameters schema."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.openai.references import CHAT_MESSAGES, SHAKESPEARE_CHAT, llm_generate

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
SUMMON = {
    "type": "object",
    "properties": {"who": {"enum": ["Romeo", "Juliet", "Nurse"]}, "urgent": {"type": "boolean"}},
    "required": ["who", "urgent"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "summon", "parameters": SUMMON}},
    {"type": "function", "function": {"name": "ring_bell"}},
]
PARAMETERS = {"get_weather": WEATHER, "summon": SUMMON, "ring_bell": {"type": "object"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Entrance(BaseModel):
    """Who enters the scene."""

    who: Literal["Romeo", "Juliet", "Nurse"]
    armed: bool


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def check_calls(choice, count: int | None = None) -> list:
    """The choice's tool calls, after checking their shape and arguments."""
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        if choice.finish_reason == "tool_calls":
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, PARAMETERS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)
    return calls


def test_named_tool_call_sampled(sdk):
    def sample(seed: int):
        return sdk.chat.completions.create(
            model="llm",
            messages=CHAT_MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        ).choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(sample, range(8)))
    for choice in choices:
        (call,) = check_calls(choice, 1)
        assert call.function.name == "get_weather"
        assert choice.finish_reason in ("tool_calls", "length")
    assert sum(c.finish_reason == "tool_calls" for c in choices) >= 4


def test_named_tool_call_greedy_equals_the_llm(sdk, server):
    params = {"temperature": 0, "max_tokens": 64}
    reply = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, tools=TOOLS, tool_choice=NAMED, **params
    )
    structured = {"json": WEATHER}  # the frontend leaves the llm's whitespace default
    expected, reasons = llm_generate(
        server, SHAKESPEARE_CHAT, {**params, "structured_outputs": structured}
    )
    choice = reply.choices[0]
    (call,) = check_calls(choice, 1)
    assert call.function.arguments == expected[0]
    assert (reasons[0], choice.finish_reason) == ("stop", "tool_calls")


def test_required_tool_call(sdk):
    stopped = 0
    for seed in range(4):
        choice = sdk.chat.completions.create(
            model="llm",
            messages=CHAT_MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=96,
        ).choices[0]
        (call,) = check_calls(choice, 1)
        assert call.function.name in PARAMETERS
        stopped += choice.finish_reason == "tool_calls"
    assert stopped >= 2


def test_required_parallel_tool_calls(sdk):
    """Several calls allowed: this model goes on calling until max_tokens; every call before
    the cut one is whole and valid."""
    choice = sdk.chat.completions.create(
        model="llm",
        messages=CHAT_MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=1,
        max_tokens=96,
    ).choices[0]
    calls = check_calls(choice)
    whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert whole
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _streamed_calls(sdk, **request) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in sdk.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:
                    assert call["id"] is None  # announced once
                    call.update(id=delta.id, name=delta.function.name)
                call["arguments"] += delta.function.arguments or ""
    return calls, reason


@pytest.mark.parametrize(
    "tool_choice,parallel,reason",
    [(NAMED, False, "tool_calls"), ("required", False, "tool_calls"), ("required", True, "length")],
    ids=["named", "required", "required-parallel-cut"],
)
def test_streamed_tool_call_deltas_join_to_the_whole(sdk, tool_choice, parallel, reason):
    request = {
        "model": "llm",
        "messages": CHAT_MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "temperature": 0,
        "max_tokens": 160 if parallel else 96,  # parallel: cut after two calls began
    }
    if parallel:  # compact JSON, the greedy output the cut at 160 tokens was chosen on
        request["extra_body"] = {"structured_outputs": {"disable_any_whitespace": True}}
    whole = sdk.chat.completions.create(**request).choices[0]
    calls, streamed_reason = _streamed_calls(sdk, **request)
    assert streamed_reason == whole.finish_reason == reason
    expected = check_calls(whole)
    assert len(expected) > 1 if parallel else len(expected) == 1
    assert list(calls) == list(range(len(expected)))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_results_in_the_conversation_are_accepted(sdk):
    first = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *CHAT_MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Rain in Verona."},
    ]
    reply = sdk.chat.completions.create(
        model="llm", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_langchain_with_structured_output_function_calling(frontend):
    chat = ChatOpenAI(
        model="llm", base_url=frontend.base_url, api_key="unused", temperature=0, max_tokens=60
    )
    messages = [("system", "A street in Verona."), ("human", "Who goes there?")]
    entrance = chat.with_structured_output(Entrance, method="function_calling").invoke(messages)
    assert isinstance(entrance, Entrance)
    schema = {"title": "summon", "description": "Summon someone", **SUMMON}
    summoned = chat.with_structured_output(schema, method="function_calling").invoke(messages)
    jsonschema.validate(summoned, SUMMON)
    bound = chat.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke(messages)
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
