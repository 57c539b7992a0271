"""Per-engine structured-output state: each constrained sequence's GrammarState, and the step's
next-token bitmask, filled on a worker thread while the model's forward runs.

Per step (see LLMEngine.step and ModelRunner.execute):
1. the runner, once it knows the step's sampling rows and before the forward, calls `begin`:
   when any row is constrained, a worker thread fills one bitmask row per constrained sampling
   row (xgrammar releases the GIL); an all-unconstrained step returns None at once;
2. after the forward, the runner waits for the `BitmaskBatch` and applies it to those logits rows
   only (a Triton kernel on GPU, a vectorised PyTorch op on CPU: kernels/token_bitmask.py);
3. after the scheduler appends the sampled tokens, the engine calls `fork` (n > 1 children,
   before the parent advances) and `accept` for every new token.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from backend_lib.llm.structured.state import GrammarState


@dataclass
class BitmaskBatch:
    """The allowed next tokens of a step's constrained sampling rows."""

    bitmask: torch.Tensor
    """[B, ceil(vocab / 32)] int32 on the host: bit t % 32 of word t // 32 allows token t."""
    rows: torch.Tensor
    """[B] int64 on the host: the logits row (sampling row) each bitmask row applies to."""
    dead_seq_ids: list[int]
    """Sequences whose grammar allows no token at all (they fail with an error)."""
    fill_seconds: float
    """Wall time the worker spent filling the bitmask."""


class BitmaskJob:
    """A bitmask being filled; `result()` waits for it."""

    def __init__(self, future: Future[BitmaskBatch]):
        self._future = future

    def result(self) -> BitmaskBatch:
        return self._future.result()


class StructuredOutputManager:
    """GrammarStates by seq_id; touched by the engine thread, and by the worker only between
    `begin` and the job's `result()` (when the engine thread leaves them alone)."""

    def __init__(self, vocab_size: int):
        """`vocab_size`: the logits width (bitmask rows cover it)."""
        self.vocab_size = vocab_size
        self._states: dict[int, GrammarState] = {}
        self._executor: ThreadPoolExecutor | None = None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, seq_id: int, grammar: xgr.CompiledGrammar) -> None:
        self._states[seq_id] = GrammarState(grammar)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts where the parent is now (call before the parent accepts)."""
        self._states[child_id] = self._states[parent_id].fork()

    def remove(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def accept(self, seq_id: int, token_id: int) -> tuple[bool, bool]:
        """Advance `seq_id` by its new token: (allowed, grammar terminated)."""
        state = self._states[seq_id]
        ok = state.accept(token_id)
        return ok, ok and state.terminated

    def begin(self, sample_seq_ids: list[int]) -> BitmaskJob | None:
        """Start filling the bitmask of the step whose sampling rows belong to `sample_seq_ids`
        (in row order); None when no row is constrained (no work, no thread hop)."""
        if not self._states:
            return None
        states = self._states
        rows = [(i, s, states[s]) for i, s in enumerate(sample_seq_ids) if s in states]
        if not rows:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        return BitmaskJob(self._executor.submit(self._fill, rows))

    def _fill(self, rows: list[tuple[int, int, GrammarState]]) -> BitmaskBatch:
        """On the worker thread: (logits row, seq_id, its state) -> one bitmask row each."""
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        dead: list[int] = []
        for b, (_, seq_id, state) in enumerate(rows):
            if not state.fill(bitmask, b) and seq_id not in dead:
                dead.append(seq_id)
        indices = torch.tensor([i for i, _, _ in rows], dtype=torch.int64)
        return BitmaskBatch(bitmask, indices, dead, time.perf_counter() - start)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
