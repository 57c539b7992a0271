"""`POST /v1/chat/completions`: text, constrained output (structured.py), forced tool calls
(tools.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from openai_frontend import tools
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
from openai_frontend.structured import output_constraint
from openai_frontend.triton import LLMResponse

router = APIRouter()


async def prepare(
    body: ChatCompletionRequest, state: FrontendState
) -> tuple[Generation, tools.ToolPlan | None]:
    body.check_supported()
    plan = tools.tool_plan(body)
    constraint = output_constraint(body, plan.schema if plan else None)
    info = await state.registry.get(body.model, "llm")
    tokenizer = state.registry.tokenizer(info)
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    listed = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt = tokenizer.render_chat(messages, info.name, listed)
    params = sampling_parameters(body, constraint, info.lora_name)
    generation = Generation(
        state.triton, info.triton_name, prompt, params, body.logprobs, constraint, info.name
    )
    return generation, plan


def _message(text: str, plan: tools.ToolPlan | None) -> dict[str, Any]:
    if plan is None:
        return {"role": "assistant", "content": text}
    parser = plan.parser()
    parser.feed(text)
    return {"role": "assistant", "content": None, "tool_calls": parser.calls()}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: State):
    generation, plan = await prepare(body, state)
    request_id, created = new_id("chatcmpl"), now()
    header = {"id": request_id, "created": created, "model": generation.model_id}
    top = requested_logprobs(body) or 0
    if body.stream:
        responses = generation.stream()
        first = await anext(responses)  # errors before the first byte are plain HTTP errors
        return sse_response(_chunks(header, first, responses, body, top, plan))
    usage = Usage()
    choices = await generation.run(usage)
    return {
        **header,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": _message(c.text, plan),
                "logprobs": chat_logprobs(c.logprobs, top) if body.logprobs else None,
                "finish_reason": tools.finish_reason(c.finish_reason) if plan else c.finish_reason,
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
    plan: tools.ToolPlan | None,
) -> AsyncIterator[dict[str, Any]]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**header, "object": "chat.completion.chunk", "choices": choices, **extra}

    n = len(first.texts)
    parsers = [plan.parser() for _ in range(n)] if plan else None

    def delta(i: int, text: str) -> dict[str, Any]:
        if parsers is None:
            return {"content": text} if text else {}
        calls = parsers[i].feed(text)
        return {"tool_calls": calls} if calls else {}

    yield chunk(
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": None if plan else ""},
                "finish_reason": None,
            }
            for i in range(n)
        ]
    )
    usage = Usage()
    async with contextlib.aclosing(responses):
        response: LLMResponse | None = first
        while response is not None:
            usage.add(response, first=response is first)
            choices = []
            for i, (text, reason, lps) in enumerate(
                zip(response.texts, response.finish_reasons, response.logprobs, strict=True)
            ):
                change = delta(i, text)
                if change or reason or lps:
                    choices.append(
                        {
                            "index": i,
                            "delta": change,
                            "logprobs": chat_logprobs(lps or [], top) if body.logprobs else None,
                            "finish_reason": tools.finish_reason(reason) if plan else reason,
                        }
                    )
            if choices:
                yield chunk(choices)
            response = await anext(responses, None)
    if body.include_usage():
        yield chunk([], usage=usage.as_dict())
