"""`qwen3_xml`: Qwen3-Coder's XML-like calls, one function per block among the text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Verona
    </parameter>
    </function>
    </tool_call>

A parameter's value is its text (one newline after the opening tag and one before the closing tag
dropped), converted by the type its tool's `parameters` schema gives it, as vLLM's qwen3_coder and
qwen3_xml parsers do: strings stay text; `null` is null; integers and numbers are parsed (an
integral number becomes an integer), booleans are `true`/`false` (anything else false); objects,
arrays and other types are parsed as JSON. A value that does not convert, or a parameter the
schema does not list, stays a string. A block left open at the end of the text is read too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from openai_frontend.tool_parsers import json_calls
from openai_frontend.tool_parsers.base import (
    BlockEnd,
    EndTag,
    Opening,
    ToolCallFormat,
    Where,
    arguments_json,
)
from openai_frontend.tool_parsers.scan import held_from

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


class Qwen3Xml(ToolCallFormat):
    name: ClassVar[str] = "qwen3_xml"

    def opening(self, text: str, where: Where) -> Opening | int:
        found = text.find(START)
        return Opening(found, found + len(START)) if found >= 0 else held_from(text, (START,))

    def block_end(self) -> BlockEnd:
        return EndTag(END)

    def parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name = function.group(1).strip()
        properties = _properties(self.parameters.get(name))
        arguments: dict[str, Any] = {}
        end = 0
        inner = function.group(2)
        for parameter in _PARAMETER.finditer(inner):
            if inner[end : parameter.start()].strip():
                return None  # text between parameters: not this format
            end = parameter.end()
            key = parameter.group(1).strip()
            arguments[key] = convert(_value(parameter.group(2)), properties.get(key))
        if inner[end:].strip():
            return None
        return [(name, arguments_json(arguments))]


def _properties(schema: Mapping[str, Any] | None) -> Mapping[str, Any]:
    properties = (schema or {}).get("properties")
    return properties if isinstance(properties, Mapping) else {}


def _value(text: str) -> str:
    if text.startswith("\n"):
        text = text[1:]
    return text[:-1] if text.endswith("\n") else text


def _type(schema: Any) -> str:
    """The JSON type a parameter's schema names (the first that is not null; string without)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return str(kind).strip().lower() if kind else "string"


def convert(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type makes of it (see the module doc)."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = _type(schema)
    try:
        if kind in _STRING_TYPES:
            return text
        if kind.startswith(_INTEGER_PREFIXES):
            return int(text)
        if kind.startswith(("num", "float")):
            number = float(text)
            if not math.isfinite(number):
                return text
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return text.lower() == "true"
        return json_calls.strict_loads(text)
    except (ValueError, OverflowError):
        return text
