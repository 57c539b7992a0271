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

Speculative decoding: the drafter keeps only the drafts the grammar allows (`num_valid_drafts`),
and a drafted sequence's d + 1 verification rows get the masks after each prefix of its drafts
(the matcher walks the drafts, then rolls back); after verification the matcher accepts the
emitted run like any new tokens.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backend_lib.llm.structured.state import GrammarState

if TYPE_CHECKING:  # imported on use: a worker rank never fills a bitmask (docs/architecture.md)
    import xgrammar as xgr


@dataclass
class BitmaskBatch:
    """The allowed next tokens of a step's constrained sampling rows."""

    bitmask: torch.Tensor
    """[B, ceil(vocab / 32)] int32 on the host: bit t % 32 of word t // 32 allows token t."""
    rows: torch.Tensor
    """[B] int64 on the host: the logits row (sampling row) each bitmask row applies to."""
    dead_seq_ids: list[int]
    """Sequences whose grammar allows no token at all (they fail with an error)."""
    dead_after_drafts: dict[int, int]
    """Drafted sequences whose grammar allows no token after their first p drafts (seq_id -> p
    >= 1): dead only if verification accepts those p drafts (ModelRunner checks)."""
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

    def num_valid_drafts(self, seq_id: int, drafts: list[int]) -> int:
        """How many leading drafts `seq_id`'s grammar allows (GrammarState.num_valid_drafts)."""
        return self._states[seq_id].num_valid_drafts(drafts)

    def num_accepted(self, seq_id: int) -> int:
        """Output tokens `seq_id`'s grammar has accepted."""
        return self._states[seq_id].num_accepted

    def begin(
        self, sample_seq_ids: list[int], drafted: list[tuple[int, list[int]]] = ()
    ) -> BitmaskJob | None:
        """Start filling the bitmask of the step whose sampling rows belong to `sample_seq_ids`
        (in row order), followed by the d + 1 verification rows of each (seq_id, drafts) in
        `drafted`; None when no row is constrained (no work, no thread hop)."""
        if not self._states:
            return None
        states = self._states
        rows = [(i, s, states[s], None) for i, s in enumerate(sample_seq_ids) if s in states]
        first = len(sample_seq_ids)
        for seq_id, drafts in drafted:
            if seq_id in states:
                rows.append((first, seq_id, states[seq_id], drafts))
            first += len(drafts) + 1
        if not rows:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        return BitmaskJob(self._executor.submit(self._fill, rows))

    def _fill(self, rows: list[tuple[int, int, GrammarState, list[int] | None]]) -> BitmaskBatch:
        """On the worker thread: (first logits row, seq_id, its state, its drafts or None) -> one
        bitmask row each, d + 1 for a drafted sequence."""
        import xgrammar as xgr

        start = time.perf_counter()
        num_rows = sum(1 if drafts is None else len(drafts) + 1 for *_, drafts in rows)
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        dead: list[int] = []
        dead_after: dict[int, int] = {}
        indices: list[int] = []
        b = 0
        for first, seq_id, state, drafts in rows:
            if drafts is None:
                if not state.fill(bitmask, b) and seq_id not in dead:
                    dead.append(seq_id)
                indices.append(first)
                b += 1
                continue
            at = state.fill_drafted(bitmask, b, drafts)
            if at == 0:
                dead.append(seq_id)
            elif at is not None:
                dead_after[seq_id] = at
            indices += range(first, first + len(drafts) + 1)
            b += len(drafts) + 1
        index = torch.tensor(indices, dtype=torch.int64)
        return BitmaskBatch(bitmask, index, dead, dead_after, time.perf_counter() - start)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
