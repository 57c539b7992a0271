"""What every tool-call parser is: a format (where a call block opens, where it ends, what its
text means) run by one scanner, `CallStream`, over a model's text whole or as it streams.

The text is content with call blocks in it. A block whose text parses is one or more calls; one
that does not (malformed JSON, a missing name, cut by max_tokens) stays content, tags and all.
Whitespace right after a parsed block is dropped, and so is whitespace before one that nothing
but whitespace precedes (it only separates the calls); every other character of content is kept.
Streamed, content goes out as it comes except what may still open a block (a partial tag; at the
start, the whitespace before it), released as soon as it cannot; a call goes out once its block
has ended and parsed (a call sent is never taken back), as two deltas: index, id, type and name,
then its arguments. So the content and calls of a text are the same however it is split:
`extract` is the stream fed the whole text.
"""

from __future__ import annotations

import enum
import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openai_frontend.tool_parsers.scan import JsonEnd


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_json(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as the JSON text of `function.arguments` (as vLLM dumps them)."""
    return json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        """`message.tool_calls` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Extracted:
    """A whole text's content and calls (content None when calls took all of it)."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A call, found: streamed as `header()` then `arguments()` (`delta.tool_calls` items)."""

    index: int
    call: ToolCall

    def header(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "id": self.call.id,
            "type": "function",
            "function": {"name": self.call.name, "arguments": ""},
        }

    def arguments(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.call.arguments}}


Delta = ContentDelta | CallDelta


class Where(enum.Enum):
    """What the text before the undecided part was."""

    START = "start"
    """Nothing but whitespace."""
    TEXT = "text"
    """Content."""
    AFTER_CALL = "after_call"
    """A parsed block (whitespace since, dropped)."""


@dataclass(frozen=True)
class Opening:
    """A block opening in a text: its opening tag spans [start, body)."""

    start: int
    body: int


class BlockEnd(ABC):
    """Finds where one block's text ends, fed its text so far (after the opening tag)."""

    @abstractmethod
    def end(self, text: str) -> tuple[int, int] | None:
        """(end of the block's body, end of the block: past its closing tag), or None while the
        block is open."""


class EndTag(BlockEnd):
    """A block closed by a tag."""

    def __init__(self, tag: str):
        self._tag = tag
        self._searched = 0

    def end(self, text: str) -> tuple[int, int] | None:
        found = text.find(self._tag, self._searched)
        if found < 0:
            self._searched = max(0, len(text) - len(self._tag) + 1)
            return None
        return found, found + len(self._tag)


class JsonBody(BlockEnd):
    """A block that is one JSON object or array (after whitespace), ending with it."""

    def __init__(self, openers: str):
        self._json = JsonEnd(openers)

    def end(self, text: str) -> tuple[int, int] | None:
        found = self._json.end(text)
        return None if found is None else (found, found)


class ToolCallFormat(ABC):
    """One model family's tool-call text. Subclasses name themselves (`name`, vLLM's
    `--tool-call-parser` name) and define where blocks open, how they end and what they mean."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False
    """The opening tag is a special token: the llm must not skip special tokens when it
    detokenizes (vLLM's Mistral parser asks the same)."""

    def __init__(self, parameters: Mapping[str, Mapping[str, Any]] | None = None):
        self.parameters = dict(parameters or {})
        """The request's tools: function name -> its parameters JSON schema."""

    @abstractmethod
    def opening(self, text: str, where: Where) -> Opening | int:
        """The first block opening in `text` (after `where`; beginning with no whitespace unless
        after content), or how many of its leading characters are content for sure (the rest may
        still open a block once more text comes)."""

    @abstractmethod
    def block_end(self) -> BlockEnd:
        """A fresh finder of a block's end."""

    @abstractmethod
    def parse(self, body: str, closed: bool) -> list[tuple[str, str]] | None:
        """A block's calls `[(name, arguments JSON text)]` from its body (`closed`: its end was
        found; False: the text ended inside it), or None when the body is not calls (the block
        then stays content)."""

    def extract(self, text: str) -> Extracted:
        """The content and calls of a whole text."""
        stream = CallStream(self)
        stream.feed(text)
        stream.finish()
        return stream.extracted()


@dataclass
class _Block:
    opening: str
    """The opening tag's text."""
    whitespace: str
    """The whitespace just before it (dropped if the block parses)."""
    end: BlockEnd
    text: str = ""


class CallStream:
    """One choice's text -> content and tool calls, fed as it streams."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None):
        self._fmt = fmt
        self._max_calls = max_calls
        """Calls past this many are dropped (parallel_tool_calls false: 1)."""
        self._text = ""
        """Text not decided yet."""
        self._whitespace = ""
        """Whitespace that began the text: content, unless a block follows."""
        self._where = Where.START
        self._block: _Block | None = None
        self._out: list[Delta] = []
        self.content = ""
        """All the content released so far."""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        """Take more text; the content and calls it releases (maybe none)."""
        if self._block is not None:
            self._block.text += text
        else:
            self._text += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """The text has ended: release everything still held."""
        return self._run(final=True)

    def extracted(self) -> Extracted:
        """Everything released so far, as a whole text's result."""
        content = self.content if self.content or not self.calls else None
        return Extracted(content, list(self.calls))

    def _run(self, final: bool) -> list[Delta]:
        while self._step(final):
            pass
        out, self._out = self._out, []
        return out

    def _step(self, final: bool) -> bool:
        """Decide what can be decided; True when more may be decided now."""
        block = self._block
        if block is not None:
            found = block.end.end(block.text)
            if found is None:
                if final:
                    self._block = None
                    self._close(block, block.text, block.text, closed=False)
                return False
            body_end, block_end = found
            self._block, self._text = None, block.text[block_end:]
            self._close(block, block.text[:body_end], block.text[:block_end], closed=True)
            return True
        text = self._text if self._where is Where.TEXT else self._text.lstrip()
        if self._where is Where.START:
            self._whitespace += self._text[: len(self._text) - len(text)]
        self._text = text
        if not text:
            if final:
                self._release(self._whitespace)
                self._whitespace = ""
            return False
        found = self._fmt.opening(text, self._where)
        if isinstance(found, int):
            if final:
                found = len(text)
            self._content(text[:found])
            self._text = text[found:]
            return False
        self._content(text[: found.start])
        self._block = _Block(
            text[found.start : found.body], self._whitespace, self._fmt.block_end()
        )
        self._block.text, self._text, self._whitespace = text[found.body :], "", ""
        return True

    def _content(self, text: str) -> None:
        """`text` is content: release it, with the whitespace held before it."""
        if not text:
            return
        self._release(self._whitespace + text)
        self._whitespace = ""
        self._where = Where.TEXT

    def _close(self, block: _Block, body: str, raw: str, closed: bool) -> None:
        calls = self._fmt.parse(body, closed)
        if not calls:
            self._release(block.whitespace + block.opening + raw)
            self._where = Where.TEXT
            return
        for name, arguments in calls:
            if self._max_calls is not None and len(self.calls) >= self._max_calls:
                break
            call = ToolCall(name, arguments)
            self._out.append(CallDelta(len(self.calls), call))
            self.calls.append(call)
        self._where = Where.AFTER_CALL

    def _release(self, text: str) -> None:
        if not text:
            return
        self.content += text
        if self._out and isinstance(self._out[-1], ContentDelta):
            self._out[-1] = ContentDelta(self._out[-1].text + text)
        else:
            self._out.append(ContentDelta(text))
