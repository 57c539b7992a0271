"""`POST /v1/embeddings`."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter

from openai_frontend.encoders import embed
from openai_frontend.errors import invalid_request
from openai_frontend.protocol import EmbeddingRequest
from openai_frontend.state import State

router = APIRouter()


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, state: State) -> dict[str, Any]:
    items = body.items()
    info = await state.registry.get(body.model, "embedding", key=body.user)
    vectors, tokens = await embed(state.triton, info, items)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise invalid_request(
            f"model `{info.name}` returns {vectors.shape[1]} dimensions and cannot reduce them "
            f"to {body.dimensions}",
            "dimensions",
        )
    return {
        "object": "list",
        "model": info.served_id,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
