"""`POST /v1/embeddings` (texts, token ids, or vLLM's multimodal `messages` form: one text or one
image of a CLIP or SigLIP model), and Hugging Face TEI's `POST /embed` (answer: a bare list of
vectors) and `POST /embed_sparse` (a sparse embedding model's: per text, its nonzero
`{"index", "value"}`)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import APIRouter

from backend_lib import contract
from backend_lib.errors import InputError
from backend_lib.multimodal.image_sources import ImageFetchPolicy, read_image_url
from backend_lib.multimodal.images import DEFAULT_MAX_IMAGE_BYTES
from openai_frontend.encoders import EmbeddingItems, embed, embed_sparse
from openai_frontend.errors import APIError, invalid_request
from openai_frontend.protocol import EmbeddingRequest, TEIEmbedRequest, TEIEmbedSparseRequest
from openai_frontend.state import State

router = APIRouter()


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, state: State) -> dict[str, Any]:
    items = await _items(body, state.config.image_fetch_policy())
    prompt_name = body.resolved_prompt_name()
    info = await state.registry.get(body.model, "embedding", key=body.user, sparse=False)
    try:
        vectors, tokens = await embed(
            state.triton, info, items, prompt_name, body.dimensions, priority=body.priority
        )
    except APIError as error:
        raise _with_param(error, body.input_type is not None) from None
    return {
        "object": "list",
        "model": info.served_id,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _items(body: EmbeddingRequest, policy: ImageFetchPolicy) -> EmbeddingItems:
    """The request's items: `input`'s texts or token ids, or the one item of `messages` (an
    image URL `policy` allows, read as the encoded image's bytes off the event loop)."""
    item = body.message_item()
    if item is None:
        return body.items()
    if isinstance(item, str):
        return [item]
    try:
        data = await asyncio.to_thread(read_image_url, item.url, policy, DEFAULT_MAX_IMAGE_BYTES)
    except InputError as exc:
        raise invalid_request(f"`image_url`: {exc}", "messages") from None
    return [data]


@router.post("/embed")
async def tei_embed(body: TEIEmbedRequest, state: State) -> Any:
    texts = body.texts()
    info = await state.registry.get(body.model, "embedding", sparse=False)
    try:
        vectors, _ = await embed(
            state.triton,
            info,
            texts,
            body.prompt_name,
            body.dimensions,
            normalize=body.normalize,
            truncate=body.truncate,
        )
    except APIError as error:
        raise _with_param(error, False) from None
    return vectors.tolist()


@router.post("/embed_sparse")
async def tei_embed_sparse(body: TEIEmbedSparseRequest, state: State) -> Any:
    texts = body.texts()
    info = await state.registry.get(body.model, "embedding", sparse=True)
    try:
        vectors, _ = await embed_sparse(
            state.triton, info, texts, body.prompt_name, truncate=body.truncate
        )
    except APIError as error:
        raise _with_param(error, False) from None
    return [
        [{"index": int(i), "value": float(v)} for i, v in zip(ids, weights, strict=True)]
        for ids, weights in vectors
    ]


def _with_param(error: APIError, sent_as_input_type: bool) -> APIError:
    """The model's 400 with `param` set to the field its message names (`'dimensions' ...`,
    `'prompt_name' ...`: the model's InputError), as the client spelled it (`input_type` when
    `sent_as_input_type`)."""
    if error.status == 400 and error.param is None:
        for field in (contract.DIMENSIONS, contract.PROMPT_NAME):
            if f"'{field}'" in error.message:
                as_input_type = field == contract.PROMPT_NAME and sent_as_input_type
                error.param = "input_type" if as_input_type else field
                break
    return error
