"""Server-sent events: `data: {json}` chunks, an error event if the stream fails after it began,
then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from openai_frontend.errors import APIError, internal

log = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
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
