"""The tool-call parsers by name (vLLM's `--tool-call-parser` names; `contract.TOOL_CALL_PARSERS`
lists the same names, those an llm's `tool_call_parser` may take)."""

from __future__ import annotations

from openai_frontend.tool_parsers.base import ToolCallFormat
from openai_frontend.tool_parsers.hermes import Hermes
from openai_frontend.tool_parsers.llama3_json import Llama3Json
from openai_frontend.tool_parsers.mistral import Mistral
from openai_frontend.tool_parsers.qwen3_xml import Qwen3Xml

FORMATS: dict[str, type[ToolCallFormat]] = {
    fmt.name: fmt for fmt in (Hermes, Llama3Json, Mistral, Qwen3Xml)
}


def tool_call_format(name: str) -> type[ToolCallFormat]:
    """The parser named `name` (KeyError for an unknown name: the llm's config checked it)."""
    return FORMATS[name]
