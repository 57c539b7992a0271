"""Reasoning parsers: a model's text -> its reasoning (`reasoning_content`) and its answer
(`content`), whole or as it streams, by vLLM's `--reasoning-parser` names
(`contract.REASONING_PARSERS`):

- `deepseek_r1`: the reasoning runs from the start of the text (its `<think>` is usually in the
  prompt; one that opens the text is dropped) to `</think>`; the content follows. Without
  `</think>` the whole text is reasoning (cut by max_tokens while thinking), as vLLM says.
- `qwen3`: reasoning only when the text opens with `<think>` (whitespace before it allowed), up to
  `</think>` (or the end); a text that does not open so is all content.

The tags are dropped; the text between and after them is kept as it is (a newline after
`</think>` begins the content), and an empty part is None. Under an output constraint (a regex,
a JSON schema) the engine constrains the text from its first token, so the model cannot think
first: deepseek_r1 then also reads reasoning only after an opening `<think>` (else a JSON answer
would all be reasoning). Streamed, text that may still be a tag is held until it cannot be one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from openai_frontend.tool_parsers.scan import held_from

THINK, END_THINK = "<think>", "</think>"
OPENING_REQUIRED = {"deepseek_r1": False, "qwen3": True}
"""Per parser: whether reasoning needs an opening `<think>`."""


@dataclass(frozen=True)
class Split:
    """Text as reasoning and content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class _State(enum.Enum):
    OPENING = "opening"
    """Whether the text opens with <think> is not known yet."""
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """One choice's text -> reasoning, then content; fed as it streams."""

    def __init__(self, parser: str, constrained: bool = False):
        self._opening_required = OPENING_REQUIRED[parser] or constrained
        self._state = _State.OPENING
        self._held = ""
        self.reasoning = ""
        self.content = ""
        """All reasoning and content released so far."""

    def feed(self, text: str) -> Split:
        """Take more text; the reasoning and content it releases."""
        return self._run(self._held + text, final=False)

    def finish(self) -> Split:
        """The text has ended: release what is held."""
        return self._run(self._held, final=True)

    def parts(self) -> tuple[str | None, str | None]:
        """(reasoning, content) of everything released, an empty one None."""
        return self.reasoning or None, self.content or None

    def _run(self, text: str, final: bool) -> Split:
        self._held = ""
        reasoning = content = ""
        if self._state is _State.OPENING:
            opened = text.lstrip()
            if opened.startswith(THINK):
                self._state, text = _State.REASONING, opened[len(THINK) :]
            elif THINK.startswith(opened) and not final:
                self._held = text
                return Split()
            elif self._opening_required:
                self._state = _State.CONTENT
            else:
                self._state = _State.REASONING
        if self._state is _State.REASONING:
            end = text.find(END_THINK)
            if end >= 0:
                reasoning, text = text[:end], text[end + len(END_THINK) :]
                self._state = _State.CONTENT
            else:
                keep = len(text) if final else held_from(text, (END_THINK,))
                reasoning, self._held, text = text[:keep], text[keep:], ""
        if self._state is _State.CONTENT:
            content = text
        self.reasoning += reasoning
        self.content += content
        return Split(reasoning, content)


def split(text: str, parser: str, constrained: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole text, an empty one None."""
    stream = ReasoningStream(parser, constrained)
    stream.feed(text)
    stream.finish()
    return stream.parts()
