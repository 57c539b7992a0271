"""One chat choice's text -> its message, whole or as stream deltas: the reasoning
(`reasoning_content`, reasoning.py, with the llm's `reasoning_parser`), then tool calls found in
the content after it (tool_choice "auto", tool_parsers/), or a forced call's JSON (tools.py).

A forced call's text is the grammar's JSON: no reasoning is read from it. Streamed, each delta
carries one kind of field; a found call is two deltas (its header, then its arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_frontend import tools
from openai_frontend.reasoning import ReasoningStream
from openai_frontend.tool_parsers.base import CallDelta, Delta


@dataclass(frozen=True)
class OutputPlan:
    """How a request's choices are read."""

    tools: tools.ToolPlan | tools.AutoTools | None
    reasoning_parser: str | None = None
    """The llm's reasoning parser (None: no reasoning is read)."""
    constrained: bool = False
    """The output is under a constraint (a regex, a schema: reasoning.py's note)."""

    @property
    def forced(self) -> bool:
        return isinstance(self.tools, tools.ToolPlan)

    def choice(self) -> ChoiceOutput:
        return ChoiceOutput(self)


class ChoiceOutput:
    """One choice's text, fed as it streams (or whole, `message`)."""

    def __init__(self, plan: OutputPlan):
        self._forced = plan.tools.parser() if isinstance(plan.tools, tools.ToolPlan) else None
        self._calls = plan.tools.stream() if isinstance(plan.tools, tools.AutoTools) else None
        self._reasoning = (
            ReasoningStream(plan.reasoning_parser, plan.constrained)
            if plan.reasoning_parser and self._forced is None
            else None
        )

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Take more of the choice's text; the `delta`s it makes (maybe none)."""
        if self._forced is not None:
            calls = self._forced.feed(text)
            return [{"tool_calls": calls}] if calls else []
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        deltas = [{"reasoning_content": split.reasoning}] if split.reasoning else []
        return deltas + self._content(split.content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The choice's text has ended: the deltas of what was held."""
        if self._forced is not None:
            return []
        deltas: list[dict[str, Any]] = []
        content = ""
        if self._reasoning is not None:
            split = self._reasoning.finish()
            if split.reasoning:
                deltas.append({"reasoning_content": split.reasoning})
            content = split.content
        return deltas + self._content(content, final=True)

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._calls is None:
            return [{"content": text}] if text else []
        found = self._calls.feed(text) if text else []
        if final:
            found += self._calls.finish()
        return [delta for item in found for delta in _deltas(item)]

    def message(self, text: str) -> dict[str, Any]:
        """`message` of the whole text."""
        if self._forced is not None:
            self._forced.feed(text)
            return {"role": "assistant", "content": None, "tool_calls": self._forced.calls()}
        self.feed(text)
        self.finish()
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._reasoning is not None:
            message["reasoning_content"], message["content"] = self._reasoning.parts()
        if self._calls is not None:
            extracted = self._calls.extracted()
            content = extracted.content
            message["content"] = content if self._reasoning is None else content or None
            if extracted.tool_calls:
                message["tool_calls"] = [call.as_dict() for call in extracted.tool_calls]
        return message

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" for a completed forced call, or when calls
        were found in a text the model ended itself (the engine's "stop"); else the engine's."""
        if self._forced is not None:
            return tools.finish_reason(engine_reason)
        if self._calls is not None and self._calls.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def _deltas(item: Delta) -> list[dict[str, Any]]:
    if isinstance(item, CallDelta):
        return [{"tool_calls": [item.header()]}, {"tool_calls": [item.arguments()]}]
    return [{"content": item.text}]
