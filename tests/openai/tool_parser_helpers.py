"""Feeding an output parser a text in pieces, and joining what it streamed."""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.tool_parsers.base import CallDelta, CallStream, ContentDelta, Delta


def split_at(text: str, *cuts: int) -> list[str]:
    """`text` cut at the positions `cuts` (ascending)."""
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stream_pieces(stream: CallStream, pieces: list[str]) -> list[Delta]:
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    return deltas + stream.finish()


def joined(deltas: list[Delta]) -> tuple[str, list[tuple[str, Any]]]:
    """(the content deltas joined, [(name, parsed arguments)] of the call deltas), checking the
    calls' indexes count up from 0 and their ids look like OpenAI's."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls = [d for d in deltas if isinstance(d, CallDelta)]
    assert [d.index for d in calls] == list(range(len(calls)))
    assert all(d.call.id.startswith("call_") and len(d.call.id) == 29 for d in calls)
    return content, [(d.call.name, json.loads(d.call.arguments)) for d in calls]


def sse_deltas(chunks: list[dict[str, Any]], index: int = 0) -> list[dict[str, Any]]:
    """The `delta`s of choice `index` in a chat stream's chunks."""
    return [c["delta"] for chunk in chunks for c in chunk["choices"] if c["index"] == index]


def join_chat_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat stream's deltas of one choice joined as a message: content, reasoning_content and
    tool_calls (each call's header delta first: index, id, type, name; then argument text)."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": []}
    for delta in deltas:
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for item in delta.get("tool_calls") or []:
            calls = message["tool_calls"]
            if "id" in item:
                assert item["index"] == len(calls) and item["type"] == "function"
                calls.append({"id": item["id"], "name": item["function"]["name"], "arguments": ""})
            calls[item["index"]]["arguments"] += item["function"].get("arguments", "")
    return message
