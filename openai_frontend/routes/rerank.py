"""`POST /v1/rerank`, `/rerank`, `/v2/rerank` (Cohere/Jina/vLLM shape, or TEI's with `texts`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.encoders import score
from openai_frontend.generation import new_id
from openai_frontend.protocol import RerankRequest
from openai_frontend.state import State

router = APIRouter()


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, state: State) -> Any:
    documents = body.document_texts()
    info = await state.registry.get(body.model, "rerank")
    pairs = [(body.query, d) for d in documents]
    scores, tokens = await score(state.triton, info, pairs, body.priority) if pairs else ([], 0)
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)[: body.top_n]
    if body.is_tei():
        return [
            {"index": i, "score": scores[i], **({"text": documents[i]} if body.return_text else {})}
            for i in order
        ]
    return {
        "id": new_id("rerank"),
        "model": info.served_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [
            {
                "index": i,
                "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_documents else {}),
            }
            for i in order
        ],
    }
