"""Structured outputs through the frontend: `response_format` with the `openai` SDK, vLLM's
`guided_*` / `structured_outputs` extras on completions, and LangChain's `with_structured_output`
(method json_schema); outputs checked with jsonschema and against the llm model called directly."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.openai.references import CHAT_MESSAGES, SHAKESPEARE_CHAT, llm_generate
from tooling.json_schemas import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.e2e
SAMPLED = SCHEMAS[::4]
"""Ten schemas of the corpus, one of each kind."""
REGEX = r"[A-Z][a-z]{1,8} (is|was) [a-z]{1,10}\."
CHOICES = ["Romeo", "Juliet", "Tybalt"]


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_sampled_json_schema_outputs_validate(sdk):
    """Seeded sampling at temperature 1: every output that stops is valid; most stop."""

    def sample(seed: int, schema: dict):
        return sdk.chat.completions.create(
            model="llm",
            messages=CHAT_MESSAGES,
            response_format=json_schema_format(schema),
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        ).choices[0]

    assert len(SAMPLED) == 10
    with ThreadPoolExecutor(len(SAMPLED)) as pool:
        choices = list(pool.map(sample, range(len(SAMPLED)), SAMPLED))
    stopped = 0
    for schema, choice in zip(SAMPLED, choices, strict=True):
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= len(SAMPLED) / 2


def test_json_object_outputs_are_objects(sdk):
    for seed in range(3):
        choice = sdk.chat.completions.create(
            model="llm",
            messages=CHAT_MESSAGES,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        ).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


@pytest.mark.parametrize("schema", [SCHEMAS[7], SCHEMAS[13]], ids=["flat", "nested"])
def test_greedy_json_schema_equals_the_llm(sdk, server, schema):
    """The frontend sends the schema as structured_outputs.json, the whitespace option as the
    client set it (unset by default: the llm's bounded whitespace)."""
    params = {"temperature": 0, "max_tokens": 60}
    reply = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, response_format=json_schema_format(schema), **params
    )
    structured = {"json": schema}
    expected, reasons = llm_generate(
        server, SHAKESPEARE_CHAT, {**params, "structured_outputs": structured}
    )
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (expected[0], reasons[0])
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    # Free whitespace on request (vLLM's option, next to response_format as vLLM merges them).
    spaced = sdk.chat.completions.create(
        model="llm",
        messages=CHAT_MESSAGES,
        response_format=json_schema_format(schema),
        extra_body={"structured_outputs": {"disable_any_whitespace": False}},
        **params,
    )
    expected, _ = llm_generate(
        server,
        SHAKESPEARE_CHAT,
        {**params, "structured_outputs": {"json": schema, "disable_any_whitespace": False}},
    )
    assert spaced.choices[0].message.content == expected[0]


def test_guided_regex_and_choice_on_completions(sdk, server):
    params = {"temperature": 0, "max_tokens": 40}
    for extra, structured in (
        ({"guided_regex": REGEX}, {"regex": REGEX}),
        ({"guided_choice": CHOICES}, {"choice": CHOICES}),
        ({"structured_outputs": {"regex": REGEX}}, {"regex": REGEX}),
    ):
        reply = sdk.completions.create(model="llm", prompt="ROMEO:", extra_body=extra, **params)
        expected, reasons = llm_generate(
            server, "ROMEO:", {**params, "structured_outputs": structured}
        )
        choice = reply.choices[0]
        assert (choice.text, choice.finish_reason) == (expected[0], reasons[0])
        assert reasons[0] == "stop"
    sampled = sdk.completions.create(
        model="llm",
        prompt=["ROMEO:", "JULIET:"],
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=40,
        extra_body={"guided_regex": REGEX},
    )
    assert len(sampled.choices) == 6
    for choice in sampled.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), choice
    streamed = sdk.completions.create(
        model="llm",
        prompt="KING:",
        stream=True,
        temperature=1.0,
        seed=9,
        max_tokens=20,
        extra_body={"guided_choice": CHOICES},
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) in CHOICES
    assert chunks[-1].finish_reason == "stop"


def test_response_format_on_completions_and_chat_stream(sdk):
    schema = SCHEMAS[9]
    reply = sdk.completions.create(
        model="llm",
        prompt="ROMEO:",
        temperature=0,
        max_tokens=60,
        extra_body={"response_format": json_schema_format(schema)},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    whole = sdk.chat.completions.create(
        model="llm",
        messages=CHAT_MESSAGES,
        response_format=json_schema_format(schema),
        temperature=0,
        max_tokens=60,
    )
    stream = sdk.chat.completions.create(
        model="llm",
        messages=CHAT_MESSAGES,
        response_format=json_schema_format(schema),
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].finish_reason == "stop"


def test_a_schema_xgrammar_rejects_names_response_format(frontend):
    sdk = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model="llm",
            messages=CHAT_MESSAGES,
            response_format=json_schema_format({"type": "frobnicate"}),
            max_tokens=5,
        )
    error = info.value.body
    assert error["param"] == "response_format"
    assert "structured_outputs.json cannot be compiled" in error["message"]


class Verdict(BaseModel):
    """A judgement of the speaker."""

    speaker: Literal["Romeo", "Juliet", "Nurse"]
    trust: int = Field(ge=0, le=9)
    honest: bool


def test_langchain_with_structured_output_json_schema(frontend):
    chat = ChatOpenAI(
        model="llm", base_url=frontend.base_url, api_key="unused", temperature=0, max_tokens=60
    )
    messages = [("system", "A street in Verona."), ("human", "Who goes there?")]
    verdict = chat.with_structured_output(Verdict, method="json_schema").invoke(messages)
    assert isinstance(verdict, Verdict)
    as_dict = chat.with_structured_output(Verdict.model_json_schema(), method="json_schema").invoke(
        messages
    )
    assert Verdict.model_validate(as_dict) == verdict
