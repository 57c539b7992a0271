"""OpenAI-shaped errors (`{"error": {message, type, param, code}}`) and the mapping of Triton's.

A model's error carries its `ErrorCode` in its message (backend_lib/contract.py), the one part of an
error a gRPC stream delivers; `from_code` maps each code to its HTTP status. An error without a
code is Triton's own, mapped by its gRPC status where it has one.
"""

from __future__ import annotations

from typing import Any

from backend_lib.contract import ErrorCode, decode_error

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def model_not_found(model: str | None) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model")


def unavailable(message: str) -> APIError:
    return APIError(503, f"tritonserver is unavailable: {message}", "service_unavailable_error")


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_server_error")


def from_code(code: ErrorCode, message: str) -> APIError:
    """The HTTP answer to a model's error of `code`."""
    if code is ErrorCode.INVALID_INPUT:
        return invalid_request(message)
    if code is ErrorCode.QUEUE_FULL:
        return APIError(
            429, message, "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if code is ErrorCode.DEADLINE_EXCEEDED:
        return APIError(504, message, "timeout_error")
    if code is ErrorCode.QUEUE_TIMEOUT:  # SGLang's queue timeout: overloaded, come back later
        return APIError(
            503, message, "service_unavailable_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if code in (ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED):
        # The frontend reads no error of a request it cancelled itself: a cancelled one was
        # stopped by the server (an unload, a shutdown), so it may be retried.
        return APIError(503, message, "service_unavailable_error")
    return internal(message)


_VERSION_GONE = ("unknown model", "is not at ready state", "is not found")


def version_gone(error: APIError) -> bool:
    """Whether Triton refused a request because its model version is not loaded (any more)."""
    text = error.message.lower()
    return any(fragment in text for fragment in _VERSION_GONE)


def from_stream_error(message: str) -> APIError:
    """An error a gRPC stream delivered (its message is all it has): by its code; one without a
    code is Triton's own failure with a request the frontend built, so internal."""
    code, text = decode_error(message)
    return from_code(code or ErrorCode.INTERNAL, text)


# Triton's own errors (no ErrorCode), by their gRPC status.
_BY_GRPC_STATUS = {
    "StatusCode.INVALID_ARGUMENT": ErrorCode.INVALID_INPUT,
    "StatusCode.UNAVAILABLE": ErrorCode.UNAVAILABLE,
    "StatusCode.DEADLINE_EXCEEDED": ErrorCode.UNAVAILABLE,
    "StatusCode.CANCELLED": ErrorCode.CANCELLED,
}


def from_triton_exception(exc: Exception) -> APIError:
    """An `InferenceServerException` (or a gRPC failure) as an APIError: by the code in its message,
    else by its gRPC status."""
    status = str(getattr(exc, "status", lambda: None)() or "")
    message = getattr(exc, "message", lambda: None)() or str(exc)
    code, text = decode_error(message)
    if code is not None:
        return from_code(code, text)
    if status == "StatusCode.NOT_FOUND":
        return APIError(404, message, "not_found_error", "model")
    if _BY_GRPC_STATUS.get(status) is ErrorCode.UNAVAILABLE:
        return unavailable(message)
    return from_code(_BY_GRPC_STATUS.get(status, ErrorCode.INTERNAL), message)
