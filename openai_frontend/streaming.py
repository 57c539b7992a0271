"""Server-sent events: `data: {json}` chunks, an error event if the stream fails after it began,
then `data: [DONE]`; or named events (`event: <type>` + `data: {json}`, each payload's `type`
naming it, no `[DONE]`), as OpenAI's Responses API streams."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from openai_frontend.errors import APIError, internal

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    # orjson: UTF-8 bytes straight to the socket (json.dumps then str.encode cost ~10x more, and
    # every streamed token is one event).
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_sse(payload: dict[str, Any]) -> bytes:
    """One event named by the payload's `type`."""
    return b"event: " + str(payload["type"]).encode() + b"\n" + sse(payload)


async def _events(chunks: AsyncIterator[dict[str, Any]], named: bool) -> AsyncIterator[bytes]:
    encode = named_sse if named else sse
    try:
        async for chunk in chunks:
            yield encode(chunk)
    except Exception as exc:  # the headers are sent: report in-band, never crash
        if not isinstance(exc, APIError):
            log.exception("stream failed")
            exc = internal(f"{type(exc).__name__}: {exc}")
        yield encode({"type": "error", **exc.body()}) if named else sse(exc.body())
    if not named:
        yield DONE


def sse_response(chunks: AsyncIterator[dict[str, Any]], named: bool = False) -> StreamingResponse:
    """A streaming response; a client that disconnects cancels `chunks` (and so its Triton
    stream, see TritonClient.generate). `named`: each chunk is an event named by its `type`,
    and no `[DONE]` ends the stream."""
    return StreamingResponse(
        _events(chunks, named),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
