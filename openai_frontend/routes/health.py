"""`GET /health` (the frontend is up), `GET /health/ready` (tritonserver is ready), `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from openai_frontend.metrics import CONTENT_TYPE
from openai_frontend.state import State

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/health/ready")
async def ready(state: State) -> Response:
    ok = await state.triton.is_ready()
    return Response(status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)
