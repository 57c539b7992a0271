"""The frontend's output constraint (openai_frontend/structured.py): `disable_any_whitespace` goes
to the llm exactly as the client set it, and is left out when the client did not (the llm's own
default then applies, as for its Triton clients)."""

from __future__ import annotations

import pytest

from openai_frontend.protocol import CompletionRequest
from openai_frontend.structured import output_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


def _constraint(**fields):
    return output_constraint(CompletionRequest(model="llm", prompt="hi", **fields))


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"response_format": JSON_SCHEMA}, {"json": SCHEMA}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        (
            {
                "response_format": JSON_SCHEMA,
                "structured_outputs": {"disable_any_whitespace": False},
            },
            {"json": SCHEMA, "disable_any_whitespace": False},
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            {"json_object": True, "disable_any_whitespace": True},
        ),
        ({"guided_regex": "a+"}, {"regex": "a+"}),
    ],
)
def test_whitespace_option_passes_through_unset_by_default(fields, expected):
    constraint = _constraint(**fields)
    assert constraint is not None and constraint.value == expected


def test_tool_schema_constraint_sets_no_whitespace_option():
    constraint = output_constraint(CompletionRequest(model="llm", prompt="hi"), SCHEMA)
    assert constraint.value == {"json": SCHEMA} and constraint.param == "tool_choice"
