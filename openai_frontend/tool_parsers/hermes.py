"""`hermes`: Hermes 2 Pro / Qwen2.5 style, each call a JSON object between tags,
`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number of them among the text.
A block left open at the end of the text is read too (as vLLM does: the model may stop on
`</tool_call>` or right after the JSON)."""

from __future__ import annotations

from typing import ClassVar

from openai_frontend.tool_parsers import json_calls
from openai_frontend.tool_parsers.base import BlockEnd, EndTag, Opening, ToolCallFormat, Where
from openai_frontend.tool_parsers.scan import held_from

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolCallFormat):
    name: ClassVar[str] = "hermes"

    def opening(self, text: str, where: Where) -> Opening | int:
        found = text.find(START)
        return Opening(found, found + len(START)) if found >= 0 else held_from(text, (START,))

    def block_end(self) -> BlockEnd:
        return EndTag(END)

    def parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        found = json_calls.call(json_calls.loads(body))
        return [found] if found else None
