"""Parallel sampling (n > 1): the prompt is prefilled once, then forked into n sequences.

The parent samples all n first tokens in the step that finishes its prompt; it keeps the first
and each other one starts a child sequence sharing the prompt's KV blocks (copy-on-write in the
KV cache manager). A seeded request gives child i the seed `seed + i` (mod 2**64), so siblings
are reproducible and not correlated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from backend_lib.llm.core.scheduler import SchedulerOutput
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.step_sampling import ModelOutput

_SEED_MODULUS = 2**64

Forks = dict[int, list[Sequence]]
"""Parent seq_id -> the children forked from it this step."""


class ParallelSampling:
    """Finds the parents due to fork and builds their children."""

    def __init__(self, device: torch.device, seq_ids: itertools.count) -> None:
        """`seq_ids`: the engine's sequence id counter (children take ids from it)."""
        self.device = device
        self._seq_ids = seq_ids

    @staticmethod
    def samples_due(
        sched_out: SchedulerOutput, is_forked: Callable[[Sequence], bool]
    ) -> dict[int, int]:
        """seq_id -> n for each n > 1 parent sampling its very first token this step (`is_forked`:
        whether a sequence's request already has its children)."""
        due = {}
        for item in sched_out.scheduled:
            seq = item.seq
            n = seq.sampling_params.n
            if n > 1 and item.samples and seq.num_output_tokens == 0 and not is_forked(seq):
                due[seq.seq_id] = n
        return due

    def split(
        self, sched_out: SchedulerOutput, model_out: ModelOutput, samples_due: dict[int, int]
    ) -> tuple[dict[int, list[int]], Forks]:
        """(seq_id -> its new tokens, forks): each parent keeps its first sample, each other sample
        starts a child."""
        sampled = dict(model_out.sampled)
        forks: Forks = {}
        if not samples_due:
            return sampled, forks
        parents = {item.seq.seq_id: item.seq for item in sched_out.scheduled}
        for parent_id in samples_due:
            tokens = model_out.sampled[parent_id]
            sampled[parent_id] = tokens[:1]
            parent = parents[parent_id]
            forks[parent_id] = [
                self._child(parent, i, token) for i, token in enumerate(tokens[1:], start=1)
            ]
        return sampled, forks

    def _child(self, parent: Sequence, index: int, first_token: int) -> Sequence:
        params = parent.sampling_params
        child = Sequence(
            next(self._seq_ids),
            parent.request_id,
            parent.prompt_token_ids + [first_token],
            parent.num_prompt_tokens,
            params,
            parent.arrival_time,
            lora_request=parent.lora_request,
            request=parent.request,
        )
        if params.seed is not None:
            # Its own stream, as the runner seeds a parent's, so siblings are not correlated.
            child.generator = torch.Generator(device=self.device)
            child.generator.manual_seed((params.seed + index) % _SEED_MODULUS)
        return child
