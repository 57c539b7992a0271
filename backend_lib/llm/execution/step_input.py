"""One engine step as every tensor-parallel rank runs it: picklable host data, no sampling state.

Rank 0 builds it from the scheduler's output (`ModelRunner.execute`), sends it to the other ranks
(execution/workers.py), and every rank turns it into the same device batch and runs the same
forward (`ModelRunner.run_step`), so their collectives line up. Only rank 0 samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend_lib.llm.core.kv_offload import OffloadMoves
from backend_lib.llm.execution.prompt_logprobs import PromptScoring


@dataclass(frozen=True)
class BlockMoves:
    """The scheduler's KV block moves of a step, applied in this order (SchedulerOutput's)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block)."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block)."""
    copy: list[tuple[int, int]] = field(default_factory=list)
    """(src device block, dst device block)."""
    offload: OffloadMoves = field(default_factory=OffloadMoves)
    """The offload tier's stores and loads (each rank moves its own shard)."""

    @classmethod
    def of(cls, sched_out) -> BlockMoves:
        """The moves of a `SchedulerOutput`."""
        return cls(
            sched_out.blocks_to_swap_out,
            sched_out.blocks_to_swap_in,
            sched_out.blocks_to_copy,
            sched_out.offload,
        )

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy or self.offload)


@dataclass(frozen=True)
class LoRAStep:
    """A step's adapters, for the other ranks to make resident in the slots rank 0 chose."""

    adapters: list[tuple[int, str, str]]
    """(lora_int_id, lora_name, lora_path) of each adapter row, in the order rank 0 activated
    them (the same order gives every rank the same slots)."""
    row_ids: list[int]
    """Per sequence, in row order: its adapter's lora_int_id (0: the base model)."""


@dataclass(frozen=True)
class StepInput:
    """A step's flattened batch on the host (rows in `row_layout` order)."""

    tokens: np.ndarray
    """int64 [T]: the new tokens of every sequence, sequence after sequence."""
    starts: np.ndarray
    """int64 [B]: each sequence's tokens already in the KV cache (its first new position)."""
    q_lens: np.ndarray
    """int64 [B]: each sequence's new tokens."""
    block_tables: list[list[int]]
    """Each sequence's KV block ids."""
    sample_indices: list[int]
    """The flattened rows whose logits are sampled (repeated for k > 1 samples)."""
    prompt_rows: list[int] = field(default_factory=list)
    """The flattened rows scoring prompt tokens (prompt_logprobs), in `prompt_scorings` order."""
    prompt_scorings: list[PromptScoring] = field(default_factory=list)
    lora: LoRAStep | None = None
    """The step's adapters (None: every row on the base model)."""


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 sends the other ranks each step: the moves, and the batch (None: none); or,
    with `read_check`, a question instead of a step."""

    moves: BlockMoves
    step: StepInput | None
    read_check: list[tuple[bytes, int]] | None = None
    """Disk reads (block hash, RAM slot) rank 0 saw finish: each rank answers, through a gather,
    which of them it could not read intact (its own shard's file)."""
