"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, translated
over chat completions (anthropic/translate.py; chat's `create` and `create_stream`). Errors have
Anthropic's shape (anthropic/errors.py, chosen by path in app.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.anthropic import translate
from openai_frontend.anthropic.protocol import CountTokensRequest, MessagesRequest
from openai_frontend.routes import chat
from openai_frontend.state import State
from openai_frontend.streaming import sse_response

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, state: State):
    request = translate.chat_request(body)
    if body.stream:
        chunks = await chat.create_stream(request, state)
        return sse_response(translate.stream_events(chunks), named=True)
    return translate.message(await chat.create(request, state))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State) -> dict[str, Any]:
    """The prompt /v1/messages renders for `body` (chat's template, tools included), counted by
    the model's tokenizer as the llm counts it (special tokens added)."""
    request = translate.chat_request(body)
    generation, _ = await chat.prepare(request, state)
    tokenizer = state.registry.tokenizer(await state.registry.get(request.model, "llm"))
    return {"input_tokens": len(tokenizer.encode(generation.prompt))}
