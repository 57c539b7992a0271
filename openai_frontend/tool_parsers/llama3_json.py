"""`llama3_json`: Llama 3.1/3.2's JSON tool calls, a bare JSON object
`{"name": "f", "parameters": {...}}` (or `arguments`) that begins the text, optionally after the
special token `<|python_tag|>`; several are separated by `;`. Calls only begin the text: once
content has come, the rest is content (JSON in prose stays prose), and so is whatever follows the
calls that is not one more `;`-separated call. `<|python_tag|>` is a special token the llm drops
from its text by default (then the object begins the text), as with vLLM's parser."""

from __future__ import annotations

from typing import ClassVar

from openai_frontend.tool_parsers import json_calls
from openai_frontend.tool_parsers.base import BlockEnd, JsonBody, Opening, ToolCallFormat, Where

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3Json(ToolCallFormat):
    name: ClassVar[str] = "llama3_json"

    def opening(self, text: str, where: Where) -> Opening | int:
        if where is Where.TEXT:
            return len(text)
        if text.startswith("{"):
            return Opening(0, 0)  # the object is the block: no tag
        tags = (PYTHON_TAG,) if where is Where.START else (SEPARATOR, PYTHON_TAG)
        for tag in tags:
            if text.startswith(tag):
                return Opening(0, len(tag))
        return 0 if any(tag.startswith(text) for tag in tags) else len(text)

    def block_end(self) -> BlockEnd:
        return JsonBody("{")

    def parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        found = json_calls.call(json_calls.loads(body)) if closed else None
        return [found] if found else None
