"""One generated sequence: its tokens, progress through the KV cache and lifecycle state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend_lib.llm.core.request import DEFAULT_TENANT, EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.lora.request import LoRARequest

if TYPE_CHECKING:  # for an annotation only: a Sequence is plain data
    import torch


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    """Queued for admission (new, or preempted by recompute)."""
    RUNNING = enum.auto()
    """Admitted: holds device KV blocks and is scheduled every step the budget allows."""
    SWAPPED = enum.auto()
    """Preempted by swap: its KV blocks live in the host pool until it is resumed."""
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """Plain state of one sequence; the scheduler and its KV-cache manager mutate it.

    Request with n > 1 has n sequences sharing `request_id` (children made by `Scheduler.fork`).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    """Prompt followed by the tokens generated so far."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    arrival_time: float
    num_computed_tokens: int = 0
    """Leading tokens whose K/V are in the cache."""
    block_table: list[int] = field(default_factory=list)
    """Device KV block ids covering positions [0, num_computed_tokens + tokens scheduled)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    """"stop" | "length" | "abort" | "error"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the sequence, if any (vLLM's stop_reason)."""
    num_cached_prompt_tokens: int = 0
    """Prefix-cache hit, in tokens, at the first admission."""
    num_offloaded_prompt_tokens: int = 0
    """Of those, read back from the offload tier (the rest were in the device pool)."""
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    """Random stream of a seeded request: the runner seeds a parent's, the engine a forked child's
    (None: unseeded, or not sampled yet)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model); kept through preemption and forks."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for its next step (speculative decoding), not in token_ids: the step
    verifies them after its last token. Consumed when scheduled (or preempted)."""
    request: EngineRequest | None = None
    """The request it serves (its forked children share it), where the scheduler reads the
    request's own fields; None for a sequence built outside the engine."""

    @property
    def priority(self) -> int:
        """Its request's priority (lower first; 0 without a request)."""
        return 0 if self.request is None else self.request.priority

    @property
    def tenant(self) -> str:
        """Its request's tenant (`EngineRequest.tenant_key`); without a request, its adapter's
        name, else the default tenant."""
        if self.request is not None:
            return self.request.tenant_key
        return DEFAULT_TENANT if self.lora_request is None else self.lora_request.lora_name

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
