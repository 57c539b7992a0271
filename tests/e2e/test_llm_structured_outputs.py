"""End to end: structured outputs through a real tritonserver, as `structured_outputs` inside
`sampling_parameters` (Triton vLLM backend clients) and as TensorRT-LLM's guided_decoding inputs;
outputs equal the engine's run directly, bad constraints are a clear error for that caller only."""

from __future__ import annotations

import json
import re
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.llm_client import grpc_stream, http_error_text, http_generate
from tests.e2e.llm_helpers import GREEDY, assert_engine_idle, direct_text, metric

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
REGEX = r"[A-Z][a-z]{1,8} (is|was) [a-z]{1,10}\."


def test_structured_outputs_in_sampling_parameters(server, direct_engine):
    before = metric(server, "llm_structured_output_requests_total")
    for structured in (
        {"json": SCHEMA, "disable_any_whitespace": True},
        {"regex": REGEX},
        {"choice": ["Romeo", "Juliet"]},
    ):
        params = {**GREEDY, "max_tokens": 40, "structured_outputs": structured}
        expected = direct_text(direct_engine, "ROMEO:", **params)
        body = {
            "text_input": "ROMEO:",
            "sampling_parameters": json.dumps(params),
            "exclude_input_in_output": True,
        }
        assert http_generate(server.http_url, body)["text_output"] == expected
        streamed = grpc_stream(server.grpc_url, "ROMEO:", params)
        assert streamed.error is None and streamed.text == expected
    assert re.fullmatch(
        REGEX,
        direct_text(direct_engine, "ROMEO:", structured_outputs={"regex": REGEX}, max_tokens=40),
    )
    assert metric(server, "llm_structured_output_requests_total") == before + 6
    assert metric(server, "llm_grammar_compile_seconds_count") >= 3
    assert metric(server, "llm_structured_output_bitmask_seconds_count") > 0
    assert_engine_idle(server)


@pytest.mark.parametrize(
    "guide_type,guide,structured",
    [
        ("regex", REGEX, {"regex": REGEX}),
        ("json_schema", json.dumps(SCHEMA), {"json": SCHEMA}),
        ("ebnf_grammar", 'root ::= "ay" | "nay"', {"grammar": 'root ::= "ay" | "nay"'}),
    ],
)
def test_guided_decoding_inputs(server, direct_engine, guide_type, guide, structured):
    expected = direct_text(direct_engine, "KING:", max_tokens=30, structured_outputs=structured)
    body = {
        "text_input": "KING:",
        "max_tokens": 30,
        "temperature": 0.0,
        "exclude_input_in_output": True,
        "guided_decoding_guide_type": guide_type,
        "guided_decoding_guide": guide,
    }
    assert http_generate(server.http_url, body)["text_output"] == expected


@pytest.mark.parametrize(
    "body,fragment",
    [
        (
            {"sampling_parameters": json.dumps({"structured_outputs": {"regex": "a(b"}})},
            "structured_outputs.regex cannot be compiled",
        ),
        (
            {"sampling_parameters": json.dumps({"structured_outputs": {"choice": []}})},
            "structured_outputs.choice must be a non-empty list",
        ),
        ({"guided_decoding_guide_type": "xml"}, "guided_decoding_guide_type' must be one of"),
    ],
)
def test_bad_constraint_is_a_clear_error_while_others_carry_on(server, body, fragment):
    params = {**GREEDY, "max_tokens": 40, "structured_outputs": {"regex": REGEX}}
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(grpc_stream, server.grpc_url, "ROMEO:", params)
        with pytest.raises(urllib.error.HTTPError) as info:
            http_generate(server.http_url, {"text_input": "hi", **body})
        assert fragment in http_error_text(info.value)
        result = good.result()
        assert result.error is None and re.fullmatch(REGEX, result.text)
