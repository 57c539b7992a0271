"""Messages API <-> chat completions: a Messages request as a ChatCompletionRequest (chat renders,
constrains and generates it), and chat's answer as a Message object or Anthropic's stream events.

Request: `system` -> a system message; a user turn's text and image blocks -> a user message
(images as chat's image_url parts: base64 sources as data: URLs) and each
`tool_result` -> a `tool` message (`tool_call_id`: its `tool_use_id`), in their order; an
assistant turn's text -> its content and each `tool_use` -> one of its `tool_calls` (`arguments`:
the input as JSON). `tools` -> functions (`parameters`: `input_schema`); `tool_choice` auto, any,
tool and none -> chat's "auto", "required", a named function and "none"
(`disable_parallel_tool_use` -> `parallel_tool_calls: false`); `stop_sequences` -> `stop`;
`output_config.format` (json_schema) -> `response_format` json_schema.

Answer: content -> a text block, each tool call -> a tool_use block (`input`: its arguments
parsed; {} when they are not a JSON object, a call cut by max_tokens); finish_reason `stop` ->
"end_turn", or "stop_sequence" when the engine's `stop_reason` is a stop string; `length` ->
"max_tokens"; `tool_calls` -> "tool_use". Reasoning (`reasoning_content`) is not answered.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from openai_frontend.anthropic import errors
from openai_frontend.anthropic.protocol import (
    BLOCKS,
    Block,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from openai_frontend.errors import APIError, internal, invalid_request
from openai_frontend.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
_TURN_BLOCKS = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use")}


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]
    )


# --- request ---------------------------------------------------------------------------------


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders and generates `body` (a count_tokens body: no sampling)."""
    body.check_supported()
    fields: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields["max_tokens"] = body.max_tokens
        for name in ("temperature", "top_p", "top_k", "priority"):
            if getattr(body, name) is not None:
                fields[name] = getattr(body, name)
        user_id = (body.metadata or {}).get("user_id")
        if isinstance(user_id, str) and user_id:
            fields["user"] = user_id  # the tenant, unless the API key is a named one
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = _response_format(body.output_config.format)
        if body.stream:
            # message_start carries the prompt's tokens: the usage comes with every chunk.
            fields["stream"] = True
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise invalid_request(_problems(exc)) from None


def _response_format(output: dict[str, Any]) -> dict[str, Any]:
    schema = output.get("schema")
    if output.get("type") != "json_schema" or not isinstance(schema, dict):
        raise invalid_request(
            '`output_config.format` must be {"type": "json_schema", "schema": {...}}',
            "output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "any":
        return "required"
    if choice.type == "tool":
        if not choice.name:
            raise invalid_request('`tool_choice` {"type": "tool"} needs `name`', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return choice.type  # "auto", "none"


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    system = body.system_text()
    if system is not None:
        chat.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        blocks = [
            _block(raw, message.role, f"messages.{i}.content.{j}")
            for j, raw in enumerate(message.content)
        ]
        chat += _assistant_turn(blocks) if message.role == "assistant" else _user_turn(blocks)
    return chat


def _block(raw: dict[str, Any], role: str, where: str) -> Block:
    kind = raw.get("type")
    model = BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None or kind not in _TURN_BLOCKS[role]:
        allowed = ", ".join(_TURN_BLOCKS[role])
        raise invalid_request(
            f"`{where}.type` {kind!r} is not supported in a {role} turn by this server "
            f"(content blocks: {allowed})",
            f"{where}.type",
        )
    try:
        block = model.model_validate(raw)
        if isinstance(block, ImageBlock):
            block.source.data_url()  # raises naming the missing field
        return block
    except (ValidationError, ValueError) as exc:
        problems = _problems(exc) if isinstance(exc, ValidationError) else str(exc)
        raise invalid_request(f"`{where}`: {problems}", where) from None


def _user_turn(blocks: list[Block]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    parts: list[TextBlock | ImageBlock] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if parts:
                chat.append({"role": "user", "content": _user_content(parts)})
                parts = []
            chat.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
            )
        elif isinstance(block, TextBlock | ImageBlock):
            parts.append(block)
    if parts or not chat:
        chat.append({"role": "user", "content": _user_content(parts)})
    return chat


def _user_content(parts: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """A user message's text, or with images chat's text and image_url parts."""
    if not any(isinstance(part, ImageBlock) for part in parts):
        return "".join(part.text for part in parts)
    return [
        {"type": "image_url", "image_url": {"url": part.source.data_url()}}
        if isinstance(part, ImageBlock)
        else {"type": "text", "text": part.text}
        for part in parts
    ]


def _assistant_turn(blocks: list[Block]) -> list[dict[str, Any]]:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    calls = [
        {
            "id": block.id,
            "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input)},
        }
        for block in blocks
        if isinstance(block, ToolUseBlock)
    ]
    if not calls:
        return [{"role": "assistant", "content": text}]
    return [{"role": "assistant", "content": text or None, "tool_calls": calls}]


# --- answer ----------------------------------------------------------------------------------


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, engine_stop: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of chat's finish_reason and the engine's stop_reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, those read from the
    prefix cache are `cache_read_input_tokens` (their sum is the prompt); nothing is written to
    a cache on request here, so `cache_creation_input_tokens` is 0."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }


def message(completion: dict[str, Any]) -> dict[str, Any]:
    """The Message object of a `chat.completion`."""
    choice = completion["choices"][0]
    answer = choice["message"]
    content: list[dict[str, Any]] = []
    if answer.get("content"):
        content.append({"type": "text", "text": answer["content"]})
    for call in answer.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": call["function"]["name"],
                "input": _input(call["function"]["arguments"]),
            }
        )
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {
        "id": message_id(completion["id"]),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(completion["usage"]),
    }


class _Events:
    """Chat chunks -> Anthropic's stream events: message_start (and a ping), then per content
    block content_block_start, its deltas (text_delta, input_json_delta) and content_block_stop,
    then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self) -> None:
        self.started = False
        self.block = -1
        self.open: str | None = None  # the type of the open block
        self.calls: dict[int, int] = {}  # chat's tool call index -> block index
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0}

    def read(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self.usage = chunk.get("usage") or self.usage
        if not self.started:
            self.started = True
            events += self._start(chunk)
        for choice in chunk["choices"]:
            if choice["index"] != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def end(self) -> list[dict[str, Any]]:
        reason, sequence = stop_reason(*self.finish)
        usage = _usage(self.usage)
        return [
            *self._close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
            {"type": "message_stop"},
        ]

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        message = {
            "id": message_id(chunk["id"]),
            "type": "message",
            "role": "assistant",
            "model": chunk["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.usage),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.block += 1
        self.open = block["type"]
        return [
            *events,
            {"type": "content_block_start", "index": self.block, "content_block": block},
        ]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.block}]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self.block, "delta": delta}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function") or {}
        events = []
        if call.get("id") is not None:
            block = {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": function.get("name"),
                "input": {},
            }
            events = self._open(block)
            self.calls[call["index"]] = self.block
        arguments = function.get("arguments")
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            index = self.calls.get(call["index"], self.block)
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events


async def stream_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's stream events of a chat stream (each payload's `type` names its event); an
    error after the stream began is an `error` event in Anthropic's shape, the last one."""
    events = _Events()
    try:
        async with contextlib.aclosing(chunks):  # closing it closes the Triton stream
            async for chunk in chunks:
                for event in events.read(chunk):
                    yield event
        for event in events.end():
            yield event
    except Exception as exc:  # the headers are sent: report in-band
        if not isinstance(exc, APIError):
            log.exception("stream failed")
            exc = internal(f"{type(exc).__name__}: {exc}")
        yield errors.body(exc)
