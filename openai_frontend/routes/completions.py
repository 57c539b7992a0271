"""`POST /v1/completions` (one or several prompts, each with `n` choices; output constraints:
structured.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from openai_frontend.discovery import ModelInfo
from openai_frontend.generation import Generation, Usage, completion_logprobs, new_id, now
from openai_frontend.protocol import CompletionRequest
from openai_frontend.sampling import sampling_parameters
from openai_frontend.state import FrontendState, State
from openai_frontend.streaming import sse_response
from openai_frontend.structured import output_constraint
from openai_frontend.triton import LLMResponse

router = APIRouter()


async def prepare(body: CompletionRequest, state: FrontendState) -> list[Generation]:
    body.check_supported()
    constraint = output_constraint(body)
    info = await state.registry.get(body.model, "llm", key=body.user)
    params = sampling_parameters(body, constraint, info.lora_name)  # the same for every prompt
    return [
        Generation(
            state.triton,
            info.triton_name,
            prompt,
            params,
            body.logprobs is not None,
            constraint,
            info.served_id,
            version=info.version,
            reroute=state.registry.rerouter(body.model, "llm", body.user),
            echo=_echo_text(body, prompt, state, info) if body.echo else "",
            prompt_only=body.echo_only,
        )
        for prompt in body.prompts()
    ]


def _echo_text(
    body: CompletionRequest, prompt: str | list[int], state: FrontendState, info: ModelInfo
) -> str:
    """The prompt's text: as sent, or a token-id prompt decoded by the model's tokenizer."""
    if isinstance(prompt, str):
        return prompt
    return state.registry.tokenizer(info).decode(prompt)


def _logprobs(
    body: CompletionRequest, entries: list, offset: int, prompt_entries: list | None = None
) -> dict[str, Any] | None:
    """The choice's logprobs; with `echo`, the prompt tokens' first (text offsets from 0)."""
    if body.logprobs is None:
        return None
    if body.echo and prompt_entries is not None:
        return completion_logprobs(prompt_entries + entries, body.logprobs, 0)
    return completion_logprobs(entries, body.logprobs, offset)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, state: State):
    generations = await prepare(body, state)
    request_id, created = new_id("cmpl"), now()
    if body.stream:
        # Prompts stream one after the other; the first is opened now so that its errors
        # (a prompt too long, a bad parameter) are plain HTTP errors.
        responses = generations[0].stream()
        first = await anext(responses)
        header = {"id": request_id, "created": created, "model": generations[0].model_id}
        return sse_response(_chunks(header, body, generations, first, responses))
    usage = Usage()
    results = await asyncio.gather(*(g.run(usage) for g in generations))
    # After the run: the version that answered is settled (see Generation.reroute).
    header = {"id": request_id, "created": created, "model": generations[0].model_id}
    choices = []
    for generation, result in zip(generations, results, strict=True):
        echo = generation.echo
        for choice in result:
            choices.append(
                {
                    "index": len(choices),
                    "text": echo + choice.text,
                    "logprobs": _logprobs(body, choice.logprobs, len(echo), choice.prompt_logprobs),
                    "finish_reason": choice.finish_reason,
                }
            )
    return {
        **header,
        "object": "text_completion",
        "choices": choices,
        "usage": usage.as_dict(),
    }


async def _chunks(
    header: dict[str, Any],
    body: CompletionRequest,
    generations: list[Generation],
    first: LLMResponse,
    first_stream: AsyncIterator[LLMResponse],
) -> AsyncIterator[dict[str, Any]]:
    usage = Usage()
    base = 0  # choice index of this prompt's first choice
    for number, generation in enumerate(generations):
        stream = first_stream if number == 0 else generation.stream()
        async with contextlib.aclosing(stream):
            response = first if number == 0 else await anext(stream)
            is_first, n = True, len(response.texts)
            offsets = [0] * n  # text already sent per choice (logprobs' text_offset)
            while response is not None:
                usage.add(response, first=is_first)
                choices = []
                for i, (text, reason, lps) in enumerate(
                    zip(response.texts, response.finish_reasons, response.logprobs, strict=True)
                ):
                    lp_offset = offsets[i]
                    if is_first and body.echo:
                        text = generation.echo + text
                        lp_offset += len(generation.echo)
                    prompt_lps = response.prompt_logprobs if is_first else None
                    if text or reason or lps:
                        choices.append(
                            {
                                "index": base + i,
                                "text": text,
                                "logprobs": _logprobs(body, lps or [], lp_offset, prompt_lps),
                                "finish_reason": reason,
                            }
                        )
                    offsets[i] += len(text)
                if choices:
                    yield {**header, "object": "text_completion", "choices": choices}
                is_first = False
                response = await anext(stream, None)
        base += n
    if body.include_usage():
        yield {**header, "object": "text_completion", "choices": [], "usage": usage.as_dict()}
