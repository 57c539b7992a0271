"""The client's timeout as the models' deadline: an `x-request-timeout` header (seconds > 0) on any
generating request (chat, completions, Responses, Messages) reaches the llm as `deadline_ms` in its
sampling_parameters, and on an embedding, rerank or score request the encoder as its Triton request
timeout (encoders.py). The engine ends a request still waiting or running at its deadline; the
client gets 504 in its API's error shape (errors.py), with the time spent. The openai and
anthropic SDKs do not send this header by themselves (their own timeouts are client-side): a
client sets it (`extra_headers`, `default_headers`).

The middleware (app.py) puts the header's text in CURRENT for the request; `deadline_ms`, called
where sampling parameters are built (sampling.py) and where encoder requests are sent
(encoders.py), reads and checks it.
"""

from __future__ import annotations

import math
from contextvars import ContextVar

from openai_frontend.errors import invalid_request

HEADER = "x-request-timeout"
CURRENT: ContextVar[str | None] = ContextVar("request_timeout", default=None)
"""This request's header text (None: the client sent none)."""


def deadline_ms() -> float | None:
    """The current request's deadline for the llm, in milliseconds from its arrival (None: none);
    an APIError (400) naming the header when it is not a number of seconds > 0."""
    value = CURRENT.get()
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise invalid_request(
            f"the {HEADER} header must be a number of seconds > 0, got {value!r}", HEADER
        )
    return seconds * 1000
