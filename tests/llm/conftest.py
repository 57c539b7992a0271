"""Fixtures for the LLM tests: tiny checkpoints, runners on them, a session that hands the runner
chosen chunks over hand-made block tables (the scheduler's job, done by hand so each test controls
exactly what the runner sees), and `single_torch_thread` for the engine-level tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import ScheduledSequence, SchedulerOutput
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.model_runner import ModelRunner
from backend_lib.llm.execution.step_input import BlockMoves
from backend_lib.llm.execution.step_sampling import ModelOutput
from tests.llm.config_helpers import BLOCK_SIZE, llm_config
from tooling.checkpoints import build_checkpoint

torch.set_num_threads(2)

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """checkpoint(arch, **config_overrides) -> (dir, HF model); each variant is built once."""
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(arch: str, **overrides: Any) -> tuple[Path, torch.nn.Module]:
        key = arch + repr(sorted(overrides.items()))
        if key not in built:
            out = tmp_path_factory.mktemp(arch)
            built[key] = (out, build_checkpoint(arch, out, **overrides))
        return built[key]

    return get


@pytest.fixture
def single_torch_thread():
    """One intra-op thread: on a shared, loaded machine a second OpenMP thread makes every tiny
    op wait for a time slice (100x slower steps); tiny models gain nothing from it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def make_runner() -> Callable[..., ModelRunner]:
    """make_runner(model_dir, device=cpu, **LLMConfig overrides) -> ModelRunner."""

    def make(model_dir: Path, device: torch.device = CPU, **overrides: Any) -> ModelRunner:
        return ModelRunner(llm_config(model_dir, **overrides), device, model_dir)

    return make


class PagedSession:
    """Feeds a ModelRunner like a scheduler would: fresh blocks per sequence, chosen chunks."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.free_blocks = list(range(runner.num_blocks))
        self._next_id = 0

    def add(self, prompt: list[int], **params: Any) -> Sequence:
        params.setdefault("temperature", 0.0)
        seq = Sequence(
            self._next_id,
            f"req-{self._next_id}",
            list(prompt),
            len(prompt),
            SamplingParams(**params),
            arrival_time=0.0,
        )
        self._next_id += 1
        return seq

    def take_block(self) -> int:
        return self.free_blocks.pop(0)

    def plan(self, chunks: list[tuple[Sequence, int | None]], **moves: Any) -> SchedulerOutput:
        """Grow block tables to cover each chunk; a chunk of None means 'all uncomputed tokens'."""
        scheduled = []
        for seq, n in chunks:
            n = seq.num_uncomputed_tokens if n is None else n
            while len(seq.block_table) * BLOCK_SIZE < seq.num_computed_tokens + n:
                seq.block_table.append(self.take_block())
            scheduled.append(ScheduledSequence(seq, n))
        return SchedulerOutput(scheduled, **moves)

    def logits(self, chunks: list[tuple[Sequence, int | None]], **moves: Any) -> torch.Tensor:
        """Run one step and return the sampling rows' logits (no token is appended)."""
        plan = self.plan(chunks, **moves)
        self.runner.apply_block_moves(BlockMoves.of(plan))
        logits = self.runner.compute_logits(self.runner.prepare_input(plan.scheduled))
        self._advance(plan)
        return logits

    def step(
        self, chunks: list[tuple[Sequence, int | None]], num_samples=None, **moves: Any
    ) -> ModelOutput:
        """Run one step through `execute`; sampling sequences get their first sampled token."""
        plan = self.plan(chunks, **moves)
        out = self.runner.execute(plan, num_samples)
        self._advance(plan)
        for s in plan.scheduled:
            if s.seq.seq_id in out.sampled:
                s.seq.append_token(out.sampled[s.seq.seq_id][0])
        return out

    @staticmethod
    def _advance(plan: SchedulerOutput) -> None:
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens


@pytest.fixture
def session(make_runner) -> Callable[..., PagedSession]:
    """session(model_dir, device=cpu, **LLMConfig overrides) -> PagedSession over a fresh runner."""
    return lambda model_dir, **overrides: PagedSession(make_runner(model_dir, **overrides))
