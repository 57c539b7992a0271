"""OpenAI-shaped errors (`{"error": {message, type, param, code}}`) and the mapping of Triton's."""

from __future__ import annotations

import re
from typing import Any

# Errors the llm sends with their Python type in front ("RuntimeError: generation failed: ...");
# input errors come bare (backend_lib.llm.serving.service.error_message).
_TYPED_ERROR = re.compile(r"^[A-Z]\w*(Error|Exception|Cancelled): ")
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


def from_llm_message(message: str) -> APIError:
    """Classify an error the llm model sent inside its stream, by its text."""
    if message.startswith("QueueFullError"):
        return APIError(
            429, message, "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if _TYPED_ERROR.match(message) or "Stub process" in message or "was cancelled" in message:
        return internal(message)
    return invalid_request(message)


def from_triton_exception(exc: Exception) -> APIError:
    """An `InferenceServerException` (or a gRPC failure) as an APIError, by its status."""
    status = str(getattr(exc, "status", lambda: None)() or "")
    message = getattr(exc, "message", lambda: None)() or str(exc)
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
        if "queue full" in message.lower():
            return from_llm_message(message)
        return unavailable(message)
    if "INVALID_ARGUMENT" in status:
        return invalid_request(message)
    if "NOT_FOUND" in status:
        return APIError(404, message, "not_found_error", "model")
    if "UNAVAILABLE" in message or "failed to connect" in message.lower():
        return unavailable(message)
    return internal(message)
