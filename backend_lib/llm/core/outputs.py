"""What the engine hands back for a request after each step (vLLM's RequestOutput shape).

Every object is a snapshot: lists are copies, so a consumer on another thread never sees the
engine's later steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend_lib.contract import ErrorCode


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (from the raw logits) and its rank (1 = most likely)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One of the request's n sampled sequences."""

    index: int
    text: str
    """Full output text so far (stop strings cut, EOS / stop-token text hidden)."""
    token_ids: list[int]
    """All output token ids so far (a final EOS or stop token included, as vLLM)."""
    delta_text: str
    """Text new since the previous output of this request."""
    delta_token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the sampled tokens' logprobs; None unless the request asked for logprobs."""
    logprobs: list[dict[int, Logprob]] | None
    """Per output token: {token_id: Logprob} of the top `logprobs` tokens plus the sampled one;
    None unless the request asked for logprobs."""
    finish_reason: str | None = None
    """None while running, else "stop", "length", "abort" or "error"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished it (None for EOS and length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds on `time.monotonic()`."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    """Ordered by index; while a request with n > 1 has not sampled yet, only index 0 exists."""
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission (device pool and offload tier)."""
    num_offloaded_cached_tokens: int = 0
    """Of those, read back from the offload tier (the rest came from the device pool)."""
    metrics: RequestMetrics | None = None
    error: str | None = None
    """Set when the request failed inside the engine (its outputs then finish with "error")."""
    error_code: ErrorCode | None = None
    """With `error`: why, as the client is told. INVALID_INPUT when the request's own input
    failed it after submission (a constraint that did not compile); INTERNAL otherwise."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token (vLLM's shape): None for the first, then {token_id: Logprob} of the top
    `prompt_logprobs` tokens plus the prompt token itself. None unless the request asked for them;
    complete from the first output with a generated token on."""
