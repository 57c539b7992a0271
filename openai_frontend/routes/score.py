"""`POST /v1/score` (vLLM's): text_1 against text_2, one-to-many or pairwise."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.encoders import score
from openai_frontend.generation import new_id, now
from openai_frontend.protocol import ScoreRequest
from openai_frontend.state import State

router = APIRouter()


@router.post("/v1/score")
@router.post("/score")
async def score_pairs(body: ScoreRequest, state: State) -> dict[str, Any]:
    pairs = body.pairs()
    info = await state.registry.get(body.model, "rerank")
    # tokens: what the model scored
    scores, tokens = await score(state.triton, info, pairs, body.priority)
    return {
        "id": new_id("score"),
        "object": "list",
        "created": now(),
        "model": info.served_id,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
