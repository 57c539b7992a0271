"""The FastAPI app: routes, error handlers (OpenAI's shape; Anthropic's on /v1/messages*), and one
ASGI middleware for the API key, the request timeout header, the body size limit and the request
metrics."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend import deadline, tenant, traffic
from openai_frontend.anthropic import errors as anthropic_errors
from openai_frontend.config import FrontendConfig
from openai_frontend.discovery import ModelRegistry
from openai_frontend.errors import APIError, internal, invalid_request
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.responses.store import ResponseStore
from openai_frontend.routes import (
    admin,
    chat,
    completions,
    embeddings,
    health,
    messages,
    models,
    rerank,
    responses,
    score,
    tokenize,
)
from openai_frontend.state import FrontendState
from openai_frontend.triton import TritonClient

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/health/ready", "/metrics")  # no API key needed


def _json_error(error: APIError, path: str) -> JSONResponse:
    """The error in the shape of the API `path` belongs to."""
    body = anthropic_errors.body(error) if anthropic_errors.serves(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _json_error(exc, request.url.path)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        error = invalid_request(f"the body is not valid JSON: {first.get('ctx', '')}")
        return _json_error(error, request.url.path)
    param = _param(tuple(first.get("loc", ())))
    message = "; ".join(f"{_param(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5])
    return _json_error(invalid_request(message, param), request.url.path)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _json_error(APIError(exc.status_code, str(exc.detail), kind), request.url.path)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("request failed")
    return _json_error(internal(f"{type(exc).__name__}: {exc}"), request.url.path)


class FrontendMiddleware:
    """API key, body size limit (the body is read here, then replayed) and metrics."""

    def __init__(self, app: ASGIApp, config: FrontendConfig, metrics: FrontendMetrics):
        self.app, self.config, self.metrics = app, config, metrics
        self.named_keys = config.named_keys()  # read once, at start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500
        routed = traffic.Routed(ab_key=_header(scope, traffic.AB_KEY_HEADER))
        token = traffic.CURRENT.set(routed)
        timeout_token = deadline.CURRENT.set(_header(scope, deadline.HEADER))
        key_name_token = tenant.CURRENT.set(None)

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if routed.version:
                    header = (traffic.VERSION_HEADER.encode(), routed.version.encode())
                    message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            error = self._check_auth(scope)
            if error is None:
                body, error = await self._read_body(scope, receive)
            if error is not None:
                await _json_error(error, scope["path"])(scope, receive, send_and_record)
            else:
                await self.app(scope, _replay(body, receive), send_and_record)
        finally:
            traffic.CURRENT.reset(token)
            deadline.CURRENT.reset(timeout_token)
            tenant.CURRENT.reset(key_name_token)
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            seconds = time.perf_counter() - started
            self.metrics.observe(endpoint, status, seconds)
            if routed.model and routed.version:
                self.metrics.observe_routed(routed.model, routed.version, status, seconds)
            for model, version in routed.rerouted:
                self.metrics.rerouted(model, version)

    def _check_auth(self, scope: Scope) -> APIError | None:
        """None when the request may pass (a named key's name then in `tenant.CURRENT`)."""
        key = self.config.api_key
        if not (key or self.named_keys) or scope["path"] in OPEN_PATHS:
            return None
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        # Anthropic's clients send the key as `x-api-key`.
        for given in (
            token.strip() if scheme.lower() == "bearer" else "",
            headers.get(b"x-api-key", b"").decode("latin-1").strip(),
        ):
            if not given:
                continue
            name = tenant.key_name(given, self.named_keys)
            if name is not None:
                tenant.CURRENT.set(name)
                return None
            if key and secrets.compare_digest(given.encode(), key.encode()):
                return None
        return APIError(401, "invalid or missing API key", "authentication_error", "api_key")

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        limit = self.config.max_body_bytes
        too_large = APIError(
            413, f"the request body is over the limit of {limit} bytes", "invalid_request_error"
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None


def _header(scope: Scope, name: str) -> str | None:
    """Header `name` (lower case) of the request, None when absent or empty."""
    value = dict(scope["headers"]).get(name.encode(), b"").decode("latin-1").strip()
    return value or None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the client's own messages (so a
    disconnect still reaches a streaming response)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(config: FrontendConfig) -> FastAPI:
    """The frontend app for `config`; the Triton client opens on the app's event loop."""
    triton = TritonClient(config.triton_url, config.triton_admin_key, config.request_timeout_s)
    metrics = FrontendMetrics()
    registry = ModelRegistry(
        triton,
        config.model_repository,
        config.index_ttl_s,
        config.chat_template,
        traffic.TrafficSplits(config.split_flags(), config.traffic_split_file),
        metrics,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await triton.close()

    app = FastAPI(title="OpenAI-compatible API for tritonserver", lifespan=lifespan)
    app.state.frontend = FrontendState(
        config, triton, registry, ResponseStore(config.responses_store_size)
    )
    app.state.metrics = metrics
    for module in (
        admin,
        models,
        chat,
        responses,
        completions,
        embeddings,
        rerank,
        score,
        tokenize,
        health,
        messages,
    ):
        app.include_router(module.router)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(FrontendMiddleware, config=config, metrics=app.state.metrics)
    return app
