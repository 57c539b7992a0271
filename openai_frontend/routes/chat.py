"""`POST /v1/chat/completions`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from openai_frontend.generation import (
    Generation,
    Usage,
    chat_logprobs,
    new_id,
    now,
)
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.sampling import requested_logprobs, sampling_parameters
from openai_frontend.state import FrontendState, State
from openai_frontend.streaming import sse_response
from openai_frontend.triton import LLMResponse

router = APIRouter()


async def prepare(body: ChatCompletionRequest, state: FrontendState) -> Generation:
    body.check_supported()
    info = await state.registry.get(body.model, "llm")
    tokenizer = state.registry.tokenizer(info)
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    prompt = tokenizer.render_chat(messages, info.name)
    params = sampling_parameters(body, info.max_model_len(), len(tokenizer.encode(prompt)))
    return Generation(state.triton, info.name, prompt, params, body.logprobs)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: State):
    generation = await prepare(body, state)
    request_id, created = new_id("chatcmpl"), now()
    header = {"id": request_id, "created": created, "model": generation.model}
    top = requested_logprobs(body) or 0
    if body.stream:
        responses = generation.stream()
        first = await anext(responses)  # errors before the first byte are plain HTTP errors
        return sse_response(_chunks(header, first, responses, body, top))
    usage = Usage()
    choices = await generation.run(usage)
    return {
        **header,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs, top) if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage.as_dict(),
    }


async def _chunks(
    header: dict[str, Any],
    first: LLMResponse,
    responses: AsyncIterator[LLMResponse],
    body: ChatCompletionRequest,
    top: int,
) -> AsyncIterator[dict[str, Any]]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**header, "object": "chat.completion.chunk", "choices": choices, **extra}

    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            for i in range(len(first.texts))
        ]
    )
    usage = Usage()
    async with contextlib.aclosing(responses):
        response: LLMResponse | None = first
        while response is not None:
            usage.add(response, first=response is first)
            choices = [
                {
                    "index": i,
                    "delta": {"content": text},
                    "logprobs": chat_logprobs(lps or [], top) if body.logprobs else None,
                    "finish_reason": reason,
                }
                for i, (text, reason, lps) in enumerate(
                    zip(response.texts, response.finish_reasons, response.logprobs, strict=True)
                )
                if text or reason or lps
            ]
            if choices:
                yield chunk(choices)
            response = await anext(responses, None)
    if body.include_usage():
        yield chunk([], usage=usage.as_dict())
