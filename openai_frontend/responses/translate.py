"""Responses API <-> chat completions: a Responses request as a `ChatCompletionRequest`, and chat's
answer (its `chat.completion` object, or its `chat.completion.chunk`s) as a `response` object
(or the Responses stream events).

Input items -> chat messages: a `message` item (role user, system, developer or assistant;
content a string or `input_text`/`output_text` parts) is a message; `function_call` items join
the assistant message before them as its `tool_calls` (or make one); a `function_call_output`
is a `tool` message; a `reasoning` item (a previous response's output) is dropped, as chat
templates drop past reasoning. `instructions` is a system message first. Tools are Responses'
flat shape `{type: "function", name, description, parameters, strict}`, `tool_choice` a mode or
`{"type": "function", "name": N}`, `text.format` chat's `response_format`.

Chat's message -> output items: `reasoning_content` a `reasoning` item, `content` a `message`
with one `output_text` part, each tool call a `function_call` item (its `call_id` the call's id).
A chat finish_reason "length" makes the response `incomplete` (reason `max_output_tokens`), and
its last item too. Errors from chat name Responses' fields (`responses_param`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from openai_frontend.errors import APIError, internal, invalid_request
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.responses.protocol import ResponsesRequest

log = logging.getLogger(__name__)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
IMAGE_PART = "input_image"
"""An image content part of a message (`image_url`: a data:, file:// or http(s) URL)."""
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TOOL_MODES = ("auto", "none", "required")
_TOOL_CHOICE_SHAPE = (
    '`tool_choice` must be "auto", "none", "required" or {"type": "function", "name": ...}'
)


def new_item_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_...`, `msg_...`, `fc_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


# Request: Responses -> chat.


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input items, checked (errors name `input.<i>...`)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [_checked_item(f"input.{i}", item) for i, item in enumerate(body.input)]


def _checked_item(where: str, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise invalid_request(
            f"input item type {kind!r} is not supported: send {', '.join(ITEM_TYPES)} items",
            f"{where}.type",
        )
    item = {**item, "type": kind}
    if kind == "message":
        if item.get("role") not in ROLES:
            raise invalid_request(
                f"a message's `role` must be one of {', '.join(ROLES)}", f"{where}.role"
            )
        _check_text(item.get("content"), f"{where}.content", images=True)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise invalid_request(
                    f"a function_call item needs `{key}` (a string)", f"{where}.{key}"
                )
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid_request(
                "a function_call_output item needs `call_id` (a string)", f"{where}.call_id"
            )
        _check_text(item.get("output"), f"{where}.output")
    return item


def _check_text(content: Any, where: str, images: bool = False) -> None:
    """Text, or a list of text parts (and, where `images`, input_image parts with an
    `image_url`)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid_request("expected a string or a list of text parts", where)
    allowed = TEXT_PARTS + (IMAGE_PART,) if images else TEXT_PARTS
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise invalid_request(
                f"content part type {kind!r} is not supported: send {', '.join(allowed)} parts "
                "(no files or audio)",
                f"{where}.{j}.type",
            )
        key = "image_url" if kind == IMAGE_PART else "text"
        if not isinstance(part.get(key), str):
            raise invalid_request(
                f"a {kind} part needs `{key}` (a string; file_id is not supported)",
                f"{where}.{j}.{key}",
            )


def _text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _chat_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or with input_image parts chat's parts."""
    if isinstance(content, str) or all(part["type"] != IMAGE_PART for part in content):
        return _text(content)
    return [
        {"type": "image_url", "image_url": {"url": part["image_url"]}}
        if part["type"] == IMAGE_PART
        else {"type": "text", "text": part["text"]}
        for part in content
    ]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of `items` (checked ones), after the instructions' system message."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chat_tools = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid_request(
                f"tool type {tool.get('type')!r} is not supported: only `function` tools (no "
                "built-in tools such as web_search, file_search or code_interpreter)",
                f"tools.{i}.type",
            )
        keys = ("name", "description", "parameters", "strict")
        function = {k: tool[k] for k in keys if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in TOOL_MODES:
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request(_TOOL_CHOICE_SHAPE, "tool_choice")


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise invalid_request(
            f"`text.format.type` must be text, json_object or json_schema (got {kind!r})",
            "text.format.type",
        )
    if not isinstance(fmt.get("schema"), dict):
        raise invalid_request(
            '`text.format` {"type": "json_schema"} needs `schema` (a JSON schema object)',
            "text.format.schema",
        )
    keys = ("name", "description", "schema", "strict")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def chat_request(
    body: ResponsesRequest, items: list[dict[str, Any]], stream: bool
) -> ChatCompletionRequest:
    """The chat request generating the response to `items` (the conversation so far)."""
    messages = chat_messages(items, body.instructions)
    if not messages:
        raise invalid_request("`input` has no items (and there are no `instructions`)", "input")
    fields = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": _chat_tools(body.tools) if body.tools else None,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "user": body.user,
        **body.sampling_extras(),
    }
    if stream:
        fields |= {"stream": True, "stream_options": {"include_usage": True}}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise invalid_request(f"{first['msg']}", responses_param(param)) from None


_RENAMED = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)


def responses_param(param: str | None) -> str | None:
    """A chat request field's name as the Responses request names it."""
    if param is None:
        return None
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":
        return ".".join([*parts[:2], *parts[3:]])  # tools.<i>.function.name -> tools.<i>.name
    for old, new in _RENAMED:
        if param == old or param.startswith(old + "."):
            return "input" if old == "messages" else new + param[len(old) :]
    return param


def renamed(error: APIError) -> APIError:
    """Chat's error, naming the Responses field."""
    error.param = responses_param(error.param)
    return error


# Answer: chat -> Responses.


@dataclass
class Draft:
    """One response being made: its id, creation time and the request's echoed settings."""

    body: ResponsesRequest
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    model: str | None = None

    def __post_init__(self) -> None:
        self.model = self.model or self.body.model

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, int] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format if body.text and body.text.format else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": body.temperature,
            "text": {"format": text_format},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": body.user,
        }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": new_item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {
        "id": new_item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": new_item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_from_chat(draft: Draft, completion: dict[str, Any]) -> dict[str, Any]:
    """The response object of chat's non-streaming answer (one choice)."""
    choice = completion["choices"][0]
    message = choice["message"]
    status = _status(choice["finish_reason"])
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(_message_item(message.get("content") or "", "completed"))
    for call in calls:
        function = call["function"]
        output.append(_call_item(call["id"], function["name"], function["arguments"], "completed"))
    output[-1]["status"] = status
    draft.model = completion["model"]
    return draft.response(status, output, completion["usage"])


def error_code(error: APIError) -> str:
    """The Responses API's `error.code` for a failed response."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.status == 400 else "server_error"


class _Events:
    """The stream's output items, and the events that open, grow and close them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # chat's tool-call index -> output index
        self._sequence = itertools.count()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.items.append(item)
        self._open = len(self.items) - 1
        events.append(
            self.event(
                "response.output_item.added", output_index=self._open, item=copy.deepcopy(item)
            )
        )
        return events

    def _open_kind(self) -> str | None:
        return None if self._open is None else self.items[self._open]["type"]

    def text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        """More text of a message (`kind` "message") or of the reasoning ("reasoning")."""
        events: list[dict[str, Any]] = []
        if self._open_kind() != kind:
            if kind == "message":
                item = _message_item("", "in_progress")
                item["content"] = []
            else:
                item = _reasoning_item("", "in_progress")
            events += self._add(item)
            if kind == "message":
                events.append(
                    self.event(
                        "response.content_part.added",
                        **self._where(self._open),
                        content_index=0,
                        part=_text_part(""),
                    )
                )
                self.items[self._open]["content"] = [_text_part("")]
        index = self._open
        assert index is not None
        if not delta:
            return events
        self.items[index]["content"][0]["text"] += delta
        extra = {"logprobs": []} if kind == "message" else {}
        name = "output_text" if kind == "message" else "reasoning_text"
        events.append(
            self.event(
                f"response.{name}.delta",
                **self._where(index),
                content_index=0,
                delta=delta,
                **extra,
            )
        )
        return events

    def call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: a new call (its id and name), or more of its arguments."""
        events: list[dict[str, Any]] = []
        function = delta.get("function") or {}
        index = self._calls.get(delta["index"])
        if index is None:
            events += self._add(_call_item(delta["id"], function["name"], "", "in_progress"))
            index = self._calls[delta["index"]] = len(self.items) - 1
        arguments = function.get("arguments") or ""
        if arguments:
            self.items[index]["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta", **self._where(index), delta=arguments
                )
            )
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (if any) with `status`."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        item["status"] = status
        where = self._where(index)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        events.append(
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))
        )
        return events


async def stream_events(
    draft: Draft,
    chunks: AsyncIterator[dict[str, Any]],
    finished: Callable[[dict[str, Any]], None],
) -> AsyncIterator[dict[str, Any]]:
    """The Responses stream events of chat's chunks; `finished` gets the final response object
    (not called when the stream fails or the client goes away)."""
    events = _Events()
    usage: dict[str, int] | None = None
    reason: str | None = None
    async with contextlib.aclosing(chunks):
        try:
            chunk: dict[str, Any] | None = await anext(chunks)
            assert chunk is not None
            draft.model = chunk["model"]
            started = draft.response("in_progress", [], None)
            yield events.event("response.created", response=started)
            yield events.event("response.in_progress", response=started)
            while chunk is not None:
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    for out in _delta_events(events, delta):
                        yield out
                    reason = choice.get("finish_reason") or reason
                usage = chunk.get("usage") or usage
                chunk = await anext(chunks, None)
        except Exception as exc:  # the stream began: report in-band
            if not isinstance(exc, APIError):
                log.exception("responses stream failed")
                exc = internal(f"{type(exc).__name__}: {exc}")
            error = renamed(exc)
            yield events.event(
                "error", code=error_code(error), message=error.message, param=error.param
            )
            failed = {"code": error_code(error), "message": error.message}
            yield events.event(
                "response.failed", response=draft.response("failed", events.items, usage, failed)
            )
            return
    status = _status(reason)
    if not any(item["type"] in ("message", "function_call") for item in events.items):
        for out in events.text("message", ""):  # an empty answer is an empty message
            yield out
    for out in events.close(status):
        yield out
    final = draft.response(status, events.items, usage)
    finished(final)
    yield events.event(f"response.{status}", response=final)


def _delta_events(events: _Events, delta: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if delta.get("reasoning_content"):
        out += events.text("reasoning", delta["reasoning_content"])
    if delta.get("content"):
        out += events.text("message", delta["content"])
    for call in delta.get("tool_calls") or []:
        out += events.call(call)
    return out
