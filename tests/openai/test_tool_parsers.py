"""The tool-call parsers (openai_frontend/tool_parsers/) on fixed model outputs: no call, one,
several, text before and after, malformed calls left as content, text that only looks like a tag;
streamed split at every character position (and one character at a time) they give the same
content and calls as the whole text."""

from __future__ import annotations

import json

import pytest

from backend_lib import contract
from openai_frontend.tool_parsers.base import CallStream, ContentDelta
from openai_frontend.tool_parsers.qwen3_xml import convert
from openai_frontend.tool_parsers.registry import FORMATS, tool_call_format
from tests.openai.tool_parser_helpers import joined, split_at, stream_pieces

WEATHER = {"city": "Verona", "days": 3}
TIME = {"zone": "CET"}
PARAMETERS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}


def _hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _qwen(name: str, **parameters: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


HERMES_WEATHER = _hermes("get_weather", '{"city": "Verona", "days": 3}')
HERMES_TIME = _hermes("get_time", '{"zone": "CET"}')
QWEN_WEATHER = _qwen("get_weather", city="Verona", days="3")
QWEN_TIME = _qwen("get_time", zone="CET")
LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Verona", "days": 3}}'
LLAMA_TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
MISTRAL_BOTH = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Verona", "days": 3}}, '
    '{"name": "get_time", "arguments": {"zone": "CET"}}]'
)
ONE = [("get_weather", WEATHER)]
BOTH = [("get_weather", WEATHER), ("get_time", TIME)]
NONE: list = []
AS_IS = "<the output itself>"
"""Content: the whole output, unchanged."""

# (parser, model output, content (AS_IS: the output), [(name, arguments)])
CASES = [
    # hermes
    ("hermes", "Thou art a villain.", AS_IS, NONE),
    ("hermes", "", AS_IS, NONE),
    ("hermes", HERMES_WEATHER, None, ONE),
    ("hermes", f"\n{HERMES_WEATHER}\n{HERMES_TIME}\n", None, BOTH),
    ("hermes", f"Let me look.\n{HERMES_WEATHER}", "Let me look.\n", ONE),
    ("hermes", f"{HERMES_WEATHER}\nDone, I think.", "Done, I think.", ONE),
    (
        "hermes",
        f"Before {HERMES_WEATHER} between {HERMES_TIME} after",
        "Before between after",
        BOTH,
    ),
    ("hermes", HERMES_WEATHER.removesuffix("</tool_call>"), None, ONE),  # open at the end: read
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": Verona}}</tool_call>',
        AS_IS,
        NONE,
    ),
    (
        "hermes",
        f'{HERMES_WEATHER}<tool_call>{{"name": 5}}</tool_call>',
        '<tool_call>{"name": 5}</tool_call>',
        ONE,
    ),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', AS_IS, NONE),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Ver', AS_IS, NONE),
    ("hermes", "a <tool of war> and <tool_cal", AS_IS, NONE),
    ("hermes", "<tool_call>", AS_IS, NONE),
    # qwen3_xml
    ("qwen3_xml", "Good morrow.", AS_IS, NONE),
    ("qwen3_xml", QWEN_WEATHER, None, ONE),
    ("qwen3_xml", f"I shall ask.\n{QWEN_WEATHER}\n{QWEN_TIME}", "I shall ask.\n", BOTH),
    ("qwen3_xml", f"{QWEN_WEATHER}\nThere.", "There.", ONE),
    ("qwen3_xml", QWEN_WEATHER.removesuffix("</tool_call>"), None, ONE),
    (
        "qwen3_xml",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</tool_call>",
        AS_IS,
        NONE,
    ),
    ("qwen3_xml", '<tool_call>{"name": "get_weather"}</tool_call>', AS_IS, NONE),
    ("qwen3_xml", "<tool_c and <func", AS_IS, NONE),
    # llama3_json
    ("llama3_json", "Soft, what light?", AS_IS, NONE),
    ("llama3_json", LLAMA_WEATHER, None, ONE),
    ("llama3_json", f"<|python_tag|>{LLAMA_WEATHER}", None, ONE),
    ("llama3_json", f" {LLAMA_WEATHER}; {LLAMA_TIME}\n", None, BOTH),
    ("llama3_json", f"{LLAMA_WEATHER};{LLAMA_TIME} and so", "and so", BOTH),
    ("llama3_json", f"Here: {LLAMA_WEATHER}", AS_IS, NONE),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Verona"', AS_IS, NONE),
    ("llama3_json", '{"city": "Verona"} is fair', AS_IS, NONE),
    ("llama3_json", '{"name": "x", "parameters": {}, "arguments": {}}', AS_IS, NONE),
    ("llama3_json", f'{LLAMA_WEATHER}; {{"name": bad}}', '; {"name": bad}', ONE),
    ("llama3_json", "<|python_tag|>print('hi')", AS_IS, NONE),
    ("llama3_json", "<|python", AS_IS, NONE),
    # mistral
    ("mistral", "What, ho!", AS_IS, NONE),
    ("mistral", MISTRAL_BOTH, None, BOTH),
    ("mistral", f"Anon. {MISTRAL_BOTH}", "Anon. ", BOTH),
    ("mistral", f"{MISTRAL_BOTH}\nAnd so.", "And so.", BOTH),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[Verona]", "days": 3}}]',
        None,
        [("get_weather", {"city": "[Verona]", "days": 3})],
    ),
    ("mistral", "[TOOL_CALLS] not an array", AS_IS, NONE),
    ("mistral", '[TOOL_CALLS][{"name": "x", "arguments": {}}', AS_IS, NONE),
    ("mistral", '[TOOL_CALLS][{"name": "x", "arguments": {}}, 5]', AS_IS, NONE),
    ("mistral", "[TOOL_CALLS][]", AS_IS, NONE),
    ("mistral", "[TOOL_CALL", AS_IS, NONE),
]


def _id(case) -> str:
    return f"{case[0]}:{case[1][:40]!r}"


def _format(name: str):
    return tool_call_format(name)(PARAMETERS)


def test_every_contract_name_has_a_parser():
    assert tuple(FORMATS) == contract.TOOL_CALL_PARSERS
    assert all(FORMATS[name].name == name for name in FORMATS)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_whole_text(case):
    name, text, content, calls = case
    content = text if content is AS_IS else content
    extracted = _format(name).extract(text)
    assert extracted.content == content
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [
        (n, json.dumps(a, ensure_ascii=False)) for n, a in calls
    ]
    assert len({c.id for c in extracted.tool_calls}) == len(calls)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_streamed_split_anywhere_equals_the_whole(case):
    name, text, content, calls = case
    content = text if content is AS_IS else content
    fmt = _format(name)
    expected = (content or "", calls)
    for cut in range(len(text) + 1):
        assert joined(stream_pieces(CallStream(fmt), split_at(text, cut))) == expected, cut
    assert joined(stream_pieces(CallStream(fmt), list(text))) == expected


def test_plain_text_streams_as_it_comes():
    stream = CallStream(_format("hermes"))
    assert stream.feed("O Romeo, ") == [ContentDelta("O Romeo, ")]
    assert stream.feed("<tool") == []  # may still open a call
    assert stream.feed("s>") == [ContentDelta("<tools>")]  # cannot any more
    assert stream.feed(" wherefore") == [ContentDelta(" wherefore")]
    assert stream.finish() == []


def test_a_call_is_sent_once_its_block_ends():
    stream = CallStream(_format("hermes"))
    head, tail = HERMES_WEATHER[:-5], HERMES_WEATHER[-5:]
    assert stream.feed(head) == []
    (delta,) = stream.feed(tail)
    assert delta.header() == {
        "index": 0,
        "id": delta.call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert delta.arguments() == {
        "index": 0,
        "function": {"arguments": '{"city": "Verona", "days": 3}'},
    }


def test_parallel_tool_calls_false_keeps_the_first_call():
    deltas = stream_pieces(
        CallStream(_format("hermes"), max_calls=1), [HERMES_WEATHER, HERMES_TIME]
    )
    assert joined(deltas) == ("", ONE)


def test_arguments_keep_non_ascii_text():
    text = _hermes("get_weather", '{"city": "Città"}')
    (call,) = _format("hermes").extract(text).tool_calls
    assert call.arguments == '{"city": "Città"}'


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("Verona", {"type": "string"}, "Verona"),
        ("3", {"type": "string"}, "3"),
        ("3", {"type": "integer"}, 3),
        ("three", {"type": "integer"}, "three"),
        ("2.5", {"type": "number"}, 2.5),
        ("2.0", {"type": "number"}, 2),
        ("inf", {"type": "number"}, "inf"),
        ("True", {"type": "boolean"}, True),
        ("maybe", {"type": "boolean"}, False),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": ["array", "null"]}, [1, 2]),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("NaN", {"type": "object"}, "NaN"),
        ("null", {"type": "integer"}, None),
        ("7", None, "7"),
    ],
)
def test_qwen3_xml_values_follow_the_schema(text, schema, value):
    assert convert(text, schema) == value


def test_qwen3_xml_values_keep_their_inner_lines():
    text = _qwen("get_weather", city="line one\nline two\n")
    (call,) = _format("qwen3_xml").extract(text).tool_calls
    assert call.arguments == '{"city": "line one\\nline two\\n"}'


def test_qwen3_xml_unknown_tool_keeps_strings():
    (call,) = _format("qwen3_xml").extract(_qwen("ring_bell", times="3")).tool_calls
    assert (call.name, call.arguments) == ("ring_bell", '{"times": "3"}')
