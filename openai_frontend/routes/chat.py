"""`POST /v1/chat/completions`: text, constrained output (structured.py), tool calls (tools.py:
forced, or found by the llm's parser), reasoning (reasoning.py); chat_output.py reads each
choice."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from openai_frontend import tools
from openai_frontend.chat_output import ChoiceOutput, OutputPlan
from openai_frontend.generation import (
    Generation,
    Usage,
    chat_logprobs,
    new_id,
    now,
)
from openai_frontend.images import read_images
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.sampling import requested_logprobs, sampling_parameters
from openai_frontend.state import FrontendState, State
from openai_frontend.streaming import sse_response
from openai_frontend.structured import output_constraint
from openai_frontend.triton import LLMResponse

router = APIRouter()


async def prepare(
    body: ChatCompletionRequest, state: FrontendState
) -> tuple[Generation, OutputPlan]:
    body.check_supported()
    info = await state.registry.get(body.model, "llm", key=body.user)
    plan = tools.tool_plan(body, info.tool_call_parser, info.name)
    forced = plan if isinstance(plan, tools.ToolPlan) else None
    constraint = output_constraint(body, forced.schema if forced else None)
    tokenizer = state.registry.tokenizer(info)
    messages = [
        {**m.model_dump(exclude_none=True), "content": m.template_content()} for m in body.messages
    ]
    urls = [url for m in body.messages for url in m.image_urls()]
    images = await read_images(urls, info, state.config.image_fetch_policy())
    listed = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt = tokenizer.render_chat(messages, info.name, listed)
    params = sampling_parameters(body, constraint, info.lora_name)
    if isinstance(plan, tools.AutoTools) and plan.format.keeps_special_tokens:
        params["skip_special_tokens"] = False  # the parser looks for a special token
    generation = Generation(
        state.triton,
        info.triton_name,
        prompt,
        params,
        body.logprobs,
        constraint,
        info.served_id,
        version=info.version,
        reroute=state.registry.rerouter(body.model, "llm", body.user),
        images=images,
    )
    return generation, OutputPlan(plan, info.reasoning_parser, constraint is not None)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: State):
    if body.stream:
        return sse_response(await create_stream(body, state))
    return await create(body, state)


def _header(generation: Generation) -> dict[str, Any]:
    return {"id": new_id("chatcmpl"), "created": now(), "model": generation.model_id}


async def create_stream(
    body: ChatCompletionRequest, state: FrontendState
) -> AsyncIterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of `body` (the seam the other chat-shaped APIs
    translate over: routes/responses.py); an error before the first chunk raises APIError here,
    before the iterator is returned."""
    generation, plan = await prepare(body, state)
    top = requested_logprobs(body) or 0
    responses = generation.stream()
    first = await anext(responses)  # errors before the first byte are plain HTTP errors
    # After the first response: the version that answers it is settled (see Generation.reroute).
    return _chunks(_header(generation), first, responses, body, top, plan)


async def create(body: ChatCompletionRequest, state: FrontendState) -> dict[str, Any]:
    """The non-streaming `chat.completion` object of `body` (its `stream` is not read)."""
    generation, plan = await prepare(body, state)
    top = requested_logprobs(body) or 0
    usage = Usage()
    choices = await generation.run(usage)
    header = _header(generation)
    outputs = [plan.choice() for _ in choices]
    return {
        **header,
        "object": "chat.completion",
        "choices": [
            {
                "index": i,
                "message": output.message(c.text),
                "logprobs": chat_logprobs(c.logprobs, top) if body.logprobs else None,
                "finish_reason": output.finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            for i, (c, output) in enumerate(zip(choices, outputs, strict=True))
        ],
        "usage": usage.as_dict(),
    }


async def _chunks(
    header: dict[str, Any],
    first: LLMResponse,
    responses: AsyncIterator[LLMResponse],
    body: ChatCompletionRequest,
    top: int,
    plan: OutputPlan,
) -> AsyncIterator[dict[str, Any]]:
    usage = Usage(prompt_tokens=first.num_input_tokens, cached_tokens=first.num_cached_tokens)
    continuous = body.continuous_usage()

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        if continuous:
            extra.setdefault("usage", usage.as_dict())
        return {**header, "object": "chat.completion.chunk", "choices": choices, **extra}

    n = len(first.texts)
    outputs = [plan.choice() for _ in range(n)]
    yield chunk(
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": None if plan.forced else ""},
                "finish_reason": None,
            }
            for i in range(n)
        ]
    )
    async with contextlib.aclosing(responses):
        response: LLMResponse | None = first
        while response is not None:
            usage.add(response, first=False)  # the prompt is counted above
            for choices in _response_chunks(response, outputs, body.logprobs, top):
                yield chunk(choices)
            response = await anext(responses, None)
    if body.include_usage():
        yield chunk([], usage=usage.as_dict())


def _response_chunks(
    response: LLMResponse, outputs: list[ChoiceOutput], logprobs: bool, top: int
) -> list[list[dict[str, Any]]]:
    """The `choices` of the chunks one llm response makes: usually one chunk; more when a choice
    has several deltas (a found tool call: its header, then its arguments). A choice's logprobs
    go in its first entry, its finish_reason in its last."""
    entries: list[list[dict[str, Any]]] = []
    for i, (text, reason, lps) in enumerate(
        zip(response.texts, response.finish_reasons, response.logprobs, strict=True)
    ):
        output = outputs[i]
        deltas = output.feed(text) if text else []
        if reason:
            deltas += output.finish()
        if not deltas and (reason or lps):
            deltas = [{}]
        entries.append(
            [
                {
                    "index": i,
                    "delta": delta,
                    "logprobs": chat_logprobs(lps or [], top) if logprobs and k == 0 else None,
                    "finish_reason": output.finish_reason(reason) if k == len(deltas) - 1 else None,
                    "stop_reason": response.stop_reasons[i] if k == len(deltas) - 1 else None,
                }
                for k, delta in enumerate(deltas)
            ]
        )
    rounds = max((len(choice) for choice in entries), default=0)
    return [[choice[k] for choice in entries if k < len(choice)] for k in range(rounds)]
