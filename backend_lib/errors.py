"""Errors that reach a client: each says what is wrong with that caller's request, and the code it
crosses the process boundary with (backend_lib/contract.py: `ErrorCode` and its codec)."""

from __future__ import annotations

from backend_lib.contract import TRITON_ERROR_CODES, ErrorCode, encode_error


class InputError(ValueError):
    """The request is malformed or out of limits. Only that request fails."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its configured maximum; the request is refused."""


class TenantLimitError(QueueFullError):
    """The request's tenant has `max_queued_per_tenant` requests waiting; the request is refused
    (queue_full: HTTP 429 at the frontend)."""


class ModelUnavailable(RuntimeError):
    """The model cannot serve any request (e.g. a worker process of a sharded model died); it asks
    to be unloaded, and serves again once loaded anew."""


class RequestCancelled(Exception):
    """The client cancelled or disconnected; the engine request was aborted and its blocks freed."""


class DeadlineExceeded(RuntimeError):
    """The request passed its deadline; the engine ended it and freed its blocks."""


class QueueTimeout(RuntimeError):
    """The request waited past the model's queue-wait limit; it may be retried later."""


_RAISED_AS = {
    ErrorCode.INVALID_INPUT: InputError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.QUEUE_TIMEOUT: QueueTimeout,
}


def request_error(code: ErrorCode | None, message: str) -> Exception:
    """The exception a request ended by the engine with `code` is answered with (its code is
    `error_code`'s of it): the request's own failure, else a RuntimeError (internal)."""
    raised_as = _RAISED_AS.get(code)
    return raised_as(message) if raised_as else RuntimeError(f"generation failed: {message}")


def error_code(exc: BaseException) -> ErrorCode:
    """The code of a failure: the request's (invalid input, queue full, cancelled, past its
    deadline or its queue wait), else internal."""
    if isinstance(exc, InputError):
        return ErrorCode.INVALID_INPUT
    if isinstance(exc, QueueFullError):
        return ErrorCode.QUEUE_FULL
    if isinstance(exc, RequestCancelled):
        return ErrorCode.CANCELLED
    if isinstance(exc, ModelUnavailable):
        return ErrorCode.UNAVAILABLE
    if isinstance(exc, DeadlineExceeded):
        return ErrorCode.DEADLINE_EXCEEDED
    if isinstance(exc, QueueTimeout):
        return ErrorCode.QUEUE_TIMEOUT
    return ErrorCode.INTERNAL


def response_error(exc: BaseException) -> tuple[str, str]:
    """(Triton error code name, message) of the response error for `exc`, which model.py sends as
    `pb_utils.TritonError(message, getattr(pb_utils.TritonError, name))`. The message carries the
    code (`contract.encode_error`); an internal error's text starts with its Python type."""
    code = error_code(exc)
    text = str(exc) if code is not ErrorCode.INTERNAL else f"{type(exc).__name__}: {exc}"
    return TRITON_ERROR_CODES[code], encode_error(code, text)
