"""The tool-call parser on JSON texts of known calls: whole and fed in pieces of every size, with
and without whitespace, it finds each call's name and its arguments' exact text."""

from __future__ import annotations

import json

import pytest

from openai_frontend.tools import CallArrayParser, NamedCallParser

CALLS = [
    {"name": "get_weather", "arguments": {"city": 'Pa"r{is}', "days": [1, {"x": None}]}},
    {"name": "ring_bell", "arguments": {}},
    {"name": "summon", "arguments": {"who": "Nurse\\", "urgent": True}},
]
LAYOUTS = {
    "spaced": {},
    "compact": {"separators": (",", ":")},
    "indented": {"indent": 2},
}


def streamed(parser, text: str, size: int) -> list[dict]:
    """The calls the parser's deltas announce, with their arguments joined."""
    calls: dict[int, dict] = {}
    for start in range(0, len(text), size):
        for delta in parser.feed(text[start : start + size]):
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function"
                calls[delta["index"]] = {"id": delta["id"], **delta["function"]}
            else:
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_call_array_whole_and_streamed(layout):
    text = json.dumps(CALLS, **LAYOUTS[layout])
    whole = CallArrayParser()
    whole.feed(text)
    calls = whole.calls()
    assert [c["function"]["name"] for c in calls] == [c["name"] for c in CALLS]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        c["arguments"] for c in CALLS
    ]
    for size in (1, 2, 5, 13, len(text)):
        parser = CallArrayParser()
        joined = streamed(parser, text, size)
        assert [(c["id"], c["name"], c["arguments"]) for c in joined] == [
            (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in parser.calls()
        ]
        assert [c["arguments"] for c in joined] == [c["function"]["arguments"] for c in calls]


def test_cut_output_lists_the_calls_begun():
    text = json.dumps(CALLS)
    cut = text[: text.index('"ring_bell"') - 5]
    parser = CallArrayParser()
    parser.feed(cut)
    (call,) = parser.calls()
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALLS[0]["arguments"]


def test_named_call_is_the_whole_text():
    text = json.dumps(CALLS[0]["arguments"])
    parser = NamedCallParser("get_weather")
    joined = streamed(parser, text, 3)
    assert joined == [{"id": parser.calls()[0]["id"], "name": "get_weather", "arguments": text}]
