"""`tools` + `tool_choice` -> how the output becomes tool calls.

`tool_choice`:
- `"none"`: the tools go to the chat template but the output is free text, never parsed;
- `"auto"` (the default with tools): free generation, the model's own tool-call text found by the
  parser its llm publishes (`tool_call_parser`, openai_frontend/tool_parsers/); refused with a
  400 naming `tool_choice` for an llm without one (vLLM without `--enable-auto-tool-choice`);
- `{"type": "function", "function": {"name": N}}`: the output is N's arguments, constrained to its
  `parameters` schema;
- `"required"`: the output is a JSON array of calls `[{"name": ..., "arguments": {...}}]`, each
  one of the tools (anyOf over the tools: the name as a const, the arguments as its parameters
  schema); one call when `parallel_tool_calls` is false.

A forced call (named, required) answers `message.tool_calls` [{id, type: "function", function:
{name, arguments}}] with `arguments` the generated JSON text, content null, and finish_reason
"tool_calls" once the grammar completed (the engine's "stop"; "length" stays: the arguments are
cut). Streamed, a call's first delta carries its index, id, type and name, the next ones more of
its arguments text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.errors import invalid_request
from openai_frontend.protocol import ChatCompletionRequest, FunctionDefinition
from openai_frontend.tool_parsers.base import CallStream, ToolCallFormat, new_call_id
from openai_frontend.tool_parsers.registry import tool_call_format

NO_PARAMETERS = {"type": "object", "properties": {}}
"""A function without `parameters` takes none (OpenAI's meaning)."""
AUTO_REFUSED = (
    '`tool_choice` "auto" (the default when `tools` are given) needs a model whose llm sets '
    "`tool_call_parser`, and model `{model}` has none, so its tool calls cannot be found in its "
    'text. Send `tool_choice` "required", {{"type": "function", "function": {{"name": ...}}}} or '
    '"none", or serve the model with a `tool_call_parser`'
)
_CHOICE_SHAPE = (
    '`tool_choice` must be "none", "auto", "required" or '
    '{"type": "function", "function": {"name": ...}}'
)


@dataclass(frozen=True)
class ToolPlan:
    """A forced call (a named function or "required"): a schema on the output, read as calls."""

    schema: dict[str, Any]
    """The JSON schema on the output."""
    function: str | None
    """The named function (the output is its arguments); None: "required" (an array of calls)."""

    def parser(self) -> ToolCallParser:
        """A parser for one choice's output."""
        return NamedCallParser(self.function) if self.function else CallArrayParser()


@dataclass(frozen=True)
class AutoTools:
    """`tool_choice` "auto": free generation; the model's tool calls are found in its text."""

    format: ToolCallFormat
    """The llm's parser, knowing the request's tools."""
    parallel: bool
    """False (`parallel_tool_calls` false): the first call only."""

    def stream(self) -> CallStream:
        """A parser for one choice's text."""
        return CallStream(self.format, None if self.parallel else 1)


def tool_plan(
    body: ChatCompletionRequest, parser: str | None = None, model: str = ""
) -> ToolPlan | AutoTools | None:
    """How the request's output becomes tool calls: forced (ToolPlan), found by the parser
    `parser` (the llm's `tool_call_parser`, for "auto"), or never (None: free text)."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise invalid_request("`tool_choice` needs `tools`", "tool_choice")
    functions = {tool.function.name: tool.function for tool in tools}
    if len(functions) != len(tools):
        raise invalid_request("`tools` has two functions with the same name", "tools")
    if choice == "auto":
        if parser is None:
            raise invalid_request(AUTO_REFUSED.format(model=model), "tool_choice")
        schemas = {name: _parameters(function) for name, function in functions.items()}
        return AutoTools(tool_call_format(parser)(schemas), body.parallel_tool_calls is not False)
    if choice == "required":
        return ToolPlan(_calls_schema(functions, body.parallel_tool_calls is not False), None)
    name = _named(choice)
    if name not in functions:
        raise invalid_request(
            f"`tool_choice` names the function {name!r}, which is not in `tools` "
            f"({', '.join(functions)})",
            "tool_choice",
        )
    return ToolPlan(_parameters(functions[name]), name)


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise invalid_request(_CHOICE_SHAPE, "tool_choice")
    return name


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def _calls_schema(functions: dict[str, FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one tool's name, "arguments": its parameters}."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _parameters(function)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def finish_reason(engine_reason: str | None) -> str | None:
    """A completed grammar (the engine's "stop") is a tool call's end."""
    return "tool_calls" if engine_reason == "stop" else engine_reason


@dataclass
class _Call:
    id: str = field(default_factory=new_call_id)
    name: str | None = None
    arguments: str = ""
    sent: int = -1
    """Characters of `arguments` streamed (-1: the call not announced yet)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallParser:
    """One choice's output -> its tool calls, fed text as it streams."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Take more output text; the new `delta.tool_calls` items (maybe none)."""
        self._read(text)
        deltas = []
        for index, call in enumerate(self._calls):
            if call.name is None:
                continue
            if call.sent < 0:
                deltas.append({"index": index, **call.as_dict()})
            elif len(call.arguments) > call.sent:
                deltas.append(
                    {"index": index, "function": {"arguments": call.arguments[call.sent :]}}
                )
            call.sent = len(call.arguments)
        return deltas

    def calls(self) -> list[dict[str, Any]]:
        """The tool calls of the text fed so far (a call is listed once its name is known)."""
        return [call.as_dict() for call in self._calls if call.name is not None]

    def _read(self, text: str) -> None:
        raise NotImplementedError


class NamedCallParser(ToolCallParser):
    """The output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._calls.append(_Call(name=name))

    def _read(self, text: str) -> None:
        self._calls[0].arguments += text


class CallArrayParser(ToolCallParser):
    """The output is a JSON array of {"name": ..., "arguments": ...} objects: a JSON scanner
    (strings, escapes, nesting) finds each call's name and the text of its arguments value."""

    _CALL_DEPTH = 2
    """Nesting depth inside a call object (1: inside the array)."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_start = -1
        self._key: str | None = None
        self._in_value = False  # inside a call object: after a key's colon
        self._value_start = -1

    def _read(self, text: str) -> None:
        start = len(self._text)
        self._text += text
        for i in range(start, len(self._text)):
            self._char(i, self._text[i])
        if self._in_value and self._value_start >= 0 and self._key == "arguments":
            self._calls[-1].arguments = self._text[self._value_start :]

    def _char(self, i: int, c: str) -> None:
        at_call = self._depth == self._CALL_DEPTH
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if at_call:
                    self._string_done(i + 1)
            return
        if c in " \t\r\n":
            return
        if at_call and self._in_value and self._value_start < 0:
            self._value_start = i
        if c == '"':
            self._in_string, self._string_start = True, i
        elif c in "{[":
            self._depth += 1
            if self._depth == self._CALL_DEPTH:
                self._calls.append(_Call())
                self._key, self._in_value = None, False
        elif c in "}]":
            if at_call and self._in_value:
                self._value_done(i)  # a number, true, false or null ends at the brace
            self._depth -= 1
            if self._depth == self._CALL_DEPTH and self._in_value:
                self._value_done(i + 1)  # the value's own object or array closed
        elif at_call and c == ":":
            self._in_value, self._value_start = True, -1
        elif at_call and c == "," and self._in_value:
            self._value_done(i)

    def _string_done(self, end: int) -> None:
        value = json.loads(self._text[self._string_start : end])
        if not self._in_value:
            self._key = value
            return
        if self._key == "name" and isinstance(value, str):
            self._calls[-1].name = value
        self._value_done(end)

    def _value_done(self, end: int) -> None:
        if self._key == "arguments":
            self._calls[-1].arguments = self._text[self._value_start : end]
        self._in_value, self._value_start = False, -1
