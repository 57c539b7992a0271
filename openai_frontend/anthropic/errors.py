"""Anthropic's error shape for the /v1/messages endpoints: `{"type": "error", "error": {"type",
"message"}}`, the type named by the HTTP status (the status itself unchanged). The other endpoints
keep OpenAI's shape (errors.py)."""

from __future__ import annotations

from typing import Any

from openai_frontend.errors import APIError

PATH = "/v1/messages"
"""The endpoints under this path answer errors in Anthropic's shape."""
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def serves(path: str) -> bool:
    """Whether the request path is one of Anthropic's endpoints."""
    return path == PATH or path.startswith(PATH + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}
