"""Running one prompt through the llm: the whole result, or its stream of responses, plus usage
and the two logprobs shapes (chat's and legacy completions')."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from openai_frontend.errors import APIError, version_gone
from openai_frontend.structured import Constraint
from openai_frontend.triton import LLMResponse, TritonClient

if TYPE_CHECKING:
    from openai_frontend.discovery import ModelInfo

LogprobEntry = dict[str, dict[str, Any]]  # {token_id: {logprob, rank, decoded_token}}
Reroute = Callable[[], Awaitable["ModelInfo | None"]]
"""Another ready version for a split-routed request (None: there is none)."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Of the prompt tokens, those read from the engine's prefix cache."""

    def add(self, response: LLMResponse, first: bool) -> None:
        # The prompt's counts repeat on every response of a request: count them once.
        if first:
            self.prompt_tokens += response.num_input_tokens
            self.cached_tokens += response.num_cached_tokens
        self.completion_tokens += sum(response.num_output_tokens)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's usage object (prompt_tokens_details.cached_tokens as OpenAI reports it)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] | None = None
    """The prompt tokens' entries, when the request asked for them (echo with logprobs)."""
    stop_reason: int | str | None = None
    """vLLM's `stop_reason`: the stop string or stop token id that finished the choice."""


@dataclass
class Generation:
    """Where one request goes: the llm model, its prompt and sampling parameters."""

    triton: TritonClient
    model: str
    prompt: str | list[int]
    """A text or token ids."""
    params: dict[str, Any]
    logprobs: bool
    constraint: Constraint | None = None
    """The output constraint in `params` (its errors name the request field it came from)."""
    served_as: str = ""
    """The model id the client asked for (a LoRA adapter's, or `model`)."""
    echo: str = ""
    """The prompt's text to answer before the output (completions' `echo`; "" without)."""
    prompt_only: bool = False
    """Answer the prompt alone: the one token generated for it is dropped (echo, max_tokens 0)."""
    version: str = ""
    """The Triton version of `model` that serves it ("": Triton's choice, the newest)."""
    reroute: Reroute | None = None
    """For a request its traffic split routed (not pinned): another ready version, asked when the
    chosen one turns out gone (unloaded since the registry last read the index)."""
    images: list[bytes] = field(default_factory=list)
    """The prompt's images, encoded, in the order of its placeholders (the llm's `image` input)."""

    @property
    def model_id(self) -> str:
        return self.served_as or self.model

    def stream(self, stream: bool = True) -> AsyncIterator[LLMResponse]:
        responses = self._responses(stream)
        if self.prompt_only:
            responses = _without_output(responses)
        if self.constraint is None:
            return responses
        return _naming_param(responses, self.constraint)

    async def run(self, usage: Usage) -> list[Choice]:
        """Every choice, whole (one non-streaming request)."""
        choices: list[Choice] = []
        async with contextlib.aclosing(self.stream(stream=False)) as responses:
            async for i, response in _enumerate(responses):
                usage.add(response, first=i == 0)
                if not choices:
                    choices = [Choice() for _ in response.texts]
                if response.prompt_logprobs is not None:
                    for choice in choices:
                        choice.prompt_logprobs = response.prompt_logprobs
                for choice, text, reason, lps, stop in zip(
                    choices,
                    response.texts,
                    response.finish_reasons,
                    response.logprobs,
                    response.stop_reasons,
                    strict=True,
                ):
                    choice.text += text
                    choice.finish_reason = reason or choice.finish_reason
                    choice.logprobs += lps or []
                    choice.stop_reason = stop if stop is not None else choice.stop_reason
        return choices

    async def _responses(self, stream: bool) -> AsyncIterator[LLMResponse]:
        """The llm's responses; a version found gone before its first response is replaced
        once by `reroute`'s choice (nothing was answered yet, so nothing is lost)."""
        for attempt in (1, 2):
            responses = self.triton.generate(
                self.model,
                self.prompt,
                self.params,
                stream=stream,
                logprobs=self.logprobs,
                version=self.version,
                images=self.images,
            )
            async with contextlib.aclosing(responses):
                try:
                    first = await anext(responses)
                except APIError as exc:
                    if attempt == 2 or self.reroute is None or not version_gone(exc):
                        raise
                    info = await self.reroute()
                    if info is None:
                        raise
                    self.version, self.served_as = info.version, info.served_id
                    continue
                yield first
                async for response in responses:
                    yield response
                return


async def _without_output(responses: AsyncIterator[LLMResponse]) -> AsyncIterator[LLMResponse]:
    """The responses with their generated text, tokens and logprobs dropped; they finish with
    "length" (the prompt used the whole budget, max_tokens 0)."""
    async with contextlib.aclosing(responses):
        async for response in responses:
            n = len(response.texts)
            reason = "length" if response.final else None
            yield replace(
                response,
                texts=[""] * n,
                finish_reasons=[reason if r is not None else None for r in response.finish_reasons],
                num_output_tokens=[0] * n,
                logprobs=[None] * n,
            )


async def _naming_param(
    responses: AsyncIterator[LLMResponse], constraint: Constraint
) -> AsyncIterator[LLMResponse]:
    async with contextlib.aclosing(responses):  # closing this closes the Triton stream
        try:
            async for response in responses:
                yield response
        except APIError as exc:
            raise constraint.name_param(exc) from None


async def _enumerate(items: AsyncIterator[LLMResponse]) -> AsyncIterator[tuple[int, LLMResponse]]:
    i = 0
    async for item in items:
        yield i, item
        i += 1


def _ranked(entry: LogprobEntry) -> list[dict[str, Any]]:
    return sorted(entry.values(), key=lambda e: e["rank"])


def _sampled(entry: LogprobEntry) -> dict[str, Any]:
    # The engine lists the sampled (or scored prompt) token first, then the top ones.
    return next(iter(entry.values()))


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[LogprobEntry], top: int) -> dict[str, Any]:
    """Chat's `logprobs`: {content: [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        sampled = _sampled(entry)
        content.append(
            {
                "token": sampled["decoded_token"],
                "logprob": sampled["logprob"],
                "bytes": _bytes(sampled["decoded_token"]),
                "top_logprobs": [
                    {
                        "token": e["decoded_token"],
                        "logprob": e["logprob"],
                        "bytes": _bytes(e["decoded_token"]),
                    }
                    for e in _ranked(entry)[:top]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(entries: list[LogprobEntry], top: int, offset: int) -> dict[str, Any]:
    """Legacy completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset. An
    entry without a logprob (the first prompt token, echoed) has null ones, as in vLLM."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        sampled = _sampled(entry)
        tokens.append(sampled["decoded_token"])
        token_logprobs.append(sampled["logprob"])
        scored = sampled["logprob"] is not None
        tops.append(
            {e["decoded_token"]: e["logprob"] for e in _ranked(entry)[:top]} if scored else None
        )
        offsets.append(offset)
        offset += len(sampled["decoded_token"])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
