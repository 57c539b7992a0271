"""Errors that reach a client: each says what is wrong with that caller's request, and the code it
crosses the process boundary with (backend_lib/contract.py: `ErrorCode` and its codec)."""

from __future__ import annotations

from backend_lib.contract import TRITON_ERROR_CODES, ErrorCode, encode_error


class InputError(ValueError):
    """The request is malformed or out of limits. Only that request fails."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its configured maximum; the request is refused."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve any request (e.g. a worker process of a sharded model died); it asks
    to be unloaded, and serves again once loaded anew."""


class RequestCancelled(Exception):
    """The client cancelled or disconnected; the engine request was aborted and its blocks freed."""


def error_code(exc: BaseException) -> ErrorCode:
    """The code of a failure: the request's (invalid input, queue full, cancelled), else internal."""
    if isinstance(exc, InputError):
        return ErrorCode.INVALID_INPUT
    if isinstance(exc, QueueFullError):
        return ErrorCode.QUEUE_FULL
    if isinstance(exc, RequestCancelled):
        return ErrorCode.CANCELLED
    if isinstance(exc, ModelUnavailable):
        return ErrorCode.UNAVAILABLE
    return ErrorCode.INTERNAL


def response_error(exc: BaseException) -> tuple[str, str]:
    """(Triton error code name, message) of the response error for `exc`, which model.py sends as
    `pb_utils.TritonError(message, getattr(pb_utils.TritonError, name))`. The message carries the
    code (`contract.encode_error`); an internal error's text starts with its Python type."""
    code = error_code(exc)
    text = str(exc) if code is not ErrorCode.INTERNAL else f"{type(exc).__name__}: {exc}"
    return TRITON_ERROR_CODES[code], encode_error(code, text)
