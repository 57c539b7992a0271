"""`GET /v1/models`, `GET /v1/models/{id}`: the READY models of tritonserver."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.discovery import ModelInfo
from openai_frontend.errors import model_not_found
from openai_frontend.state import State

router = APIRouter()


def model_object(info: ModelInfo) -> dict[str, Any]:
    return {
        "id": info.name,
        "object": "model",
        "created": info.created,
        "owned_by": "triton",
        # Not OpenAI's: what the model is and its Triton version, for clients that care.
        "kind": info.kind,
        "version": info.version,
        "max_model_len": info.max_model_len,  # the engine's, as the llm published it
        "parent": info.parent,  # vLLM's: the base model of a LoRA adapter
    }


@router.get("/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in await state.registry.list()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: State) -> dict[str, Any]:
    if not model_id:
        raise model_not_found(model_id)
    # A pinned id (`llm:2`) is listed as itself.
    return {**model_object(await state.registry.get(model_id, None)), "id": model_id}
