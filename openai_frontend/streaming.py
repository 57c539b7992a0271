"""Server-sent events: `data: {json}` chunks, an error event if the stream fails after it began,
then `data: [DONE]`."""

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


async def _events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:  # the headers are sent: report in-band, never crash
        log.exception("stream failed")
        yield sse(internal(f"{type(exc).__name__}: {exc}").body())
    yield DONE


def sse_response(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """A streaming response; a client that disconnects cancels `chunks` (and so its Triton
    stream, see TritonClient.generate)."""
    return StreamingResponse(
        _events(chunks),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
