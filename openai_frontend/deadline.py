"""The client's own timeout as the llm's deadline: the `x-request-timeout` header (seconds), set on
any generating request (chat, completions, Responses, Messages), reaches the llm as `deadline_ms`
in its sampling_parameters. The engine ends a request still waiting or running at its deadline;
the client gets 504 in its API's error shape (errors.py), with the time spent.

The middleware (app.py) reads the header once per request into CURRENT; `sampling.py` reads it
there, so every route that builds sampling parameters carries it without passing it along.
"""

from __future__ import annotations

import math
from contextvars import ContextVar

from openai_frontend.errors import invalid_request

HEADER = "x-request-timeout"
CURRENT: ContextVar[float | None] = ContextVar("request_timeout_s", default=None)
"""This request's timeout in seconds (None: the client set none)."""


def parse(value: str | None) -> float | None:
    """The header's seconds; an APIError (400) naming the header when it is not a number > 0."""
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
    return seconds


def deadline_ms() -> float | None:
    """The current request's deadline for the llm, in milliseconds from its arrival."""
    seconds = CURRENT.get()
    return None if seconds is None else seconds * 1000
