"""OpenAI request fields -> the llm model's `sampling_parameters` JSON (vLLM's names)."""

from __future__ import annotations

from typing import Any

from openai_frontend import deadline, tenant
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from openai_frontend.structured import Constraint

# Passed through under the same name when the client set them.
_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
)


def sampling_parameters(
    body: SamplingFields, constraint: Constraint | None = None, lora_name: str | None = None
) -> dict[str, Any]:
    """The `sampling_parameters` of one generate request for `body`; `constraint`: its output
    constraint (structured.py), sent as `structured_outputs`; `lora_name`: the LoRA adapter the
    requested model id names (discovery.py). Without `max_tokens`, `max_tokens: null` is sent: the
    engine then generates up to its max_model_len (vLLM's default), so the frontend never counts
    the prompt."""
    params: dict[str, Any] = {
        name: getattr(body, name) for name in _PASSTHROUGH if getattr(body, name) is not None
    }
    if lora_name is not None:
        params["lora_name"] = lora_name
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if isinstance(body, CompletionRequest) and body.echo_only:
        max_tokens = 1  # vLLM's echo without generation: one token is sampled, none answered
    # Always sent: None asks the engine for everything up to its max_model_len (vLLM's chat
    # default, and this frontend's for completions too); left out, the engine would apply
    # SamplingParams' own default of 16.
    params["max_tokens"] = max_tokens
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.ignore_eos:
        params["ignore_eos"] = True
    if body.min_tokens:
        params["min_tokens"] = body.min_tokens
    if body.n != 1:
        params["n"] = body.n
    if body.priority:
        params["priority"] = body.priority
    served_for = tenant.tenant(body.user)
    if served_for is not None:
        params["tenant"] = served_for
    timeout_ms = deadline.deadline_ms()
    if timeout_ms is not None:
        params["deadline_ms"] = timeout_ms
    logprobs = requested_logprobs(body)
    if logprobs is not None:
        params["logprobs"] = logprobs
        if isinstance(body, CompletionRequest) and body.echo:
            params["prompt_logprobs"] = logprobs  # the echoed prompt's tokens get theirs too
    if constraint is not None:
        params["structured_outputs"] = constraint.value
    return params


def requested_logprobs(body: SamplingFields) -> int | None:
    """How many top logprobs per token the engine must return (None: no logprobs)."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return None
