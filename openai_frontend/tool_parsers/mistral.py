"""`mistral`: Mistral 7B Instruct v0.3 style (mistral_common's tokenizers before v11), the
special token `[TOOL_CALLS]` then a JSON array of calls,
`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, after any text. The array ends the block;
text after it is content. The llm keeps special tokens in its text for this parser."""

from __future__ import annotations

from typing import ClassVar

from openai_frontend.tool_parsers import json_calls
from openai_frontend.tool_parsers.base import BlockEnd, JsonBody, Opening, ToolCallFormat, Where
from openai_frontend.tool_parsers.scan import held_from

START = "[TOOL_CALLS]"


class Mistral(ToolCallFormat):
    name: ClassVar[str] = "mistral"
    keeps_special_tokens: ClassVar[bool] = True

    def opening(self, text: str, where: Where) -> Opening | int:
        found = text.find(START)
        return Opening(found, found + len(START)) if found >= 0 else held_from(text, (START,))

    def block_end(self) -> BlockEnd:
        return JsonBody("[")

    def parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        return json_calls.calls(json_calls.loads(body)) if closed else None
