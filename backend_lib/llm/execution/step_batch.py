"""A scheduler step as one flattened device batch (`ModelInput`), built by `StepBatcher`.

Rows are laid out by `row_layout` (decodes first, then chunks, each grouped by adapter slot);
sampling rows keep the scheduled order. A sequence verifying drafts (speculative decoding) gets
d + 1 consecutive sampling rows after every plain sample's (`DraftedSequence`). Rank 0 builds
the host data (`StepInput`, what the other tensor-parallel ranks get) and its sampling rows; every
rank turns a `StepInput` into the same device batch (`device_input`).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.core.scheduler import ScheduledSequence
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.attention import AttentionMetadata
from backend_lib.llm.execution.flat_batch import flat_batch
from backend_lib.llm.execution.mm_embeds import ImageSlice, image_slices, visible_until
from backend_lib.llm.execution.prompt_logprobs import (
    PromptLogprobsChunk,
    PromptScoring,
    prompt_scoring,
)
from backend_lib.llm.execution.runner_lora import RunnerLoRA
from backend_lib.llm.execution.sampler import SamplingRow
from backend_lib.llm.execution.step_input import LoRAStep, StepInput
from backend_lib.llm.lora.batch import LoRABatch
from kernels import KernelOps, lora_segments


@dataclass
class DraftedSequence:
    """One sequence verifying drafts this step: its d + 1 consecutive sampling rows."""

    seq_id: int
    draft_token_ids: list[int]
    rows: list[SamplingRow]
    """d + 1 rows, one per verified position: row i's history is the sequence's tokens plus the
    first i drafts."""


def drafted_sequence(item: ScheduledSequence, row: SamplingRow) -> DraftedSequence:
    """The verification rows of a scheduled decode with drafts, from its plain sampling row."""
    drafts = item.spec_token_ids
    history = list(row.token_ids)
    rows = [
        SamplingRow(row.params, history + drafts[:i], row.num_prompt_tokens, row.generator)
        for i in range(len(drafts) + 1)
    ]
    return DraftedSequence(item.seq.seq_id, drafts, rows)


@dataclass
class ModelInput:
    """One flattened step, on device, plus the host-side list of rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    """[R] int64: the flattened row whose logits each sample uses (repeated for k > 1)."""
    sample_rows: list[SamplingRow]
    """One per plain sample (the first len(sample_rows) of sample_indices)."""
    sample_seq_ids: list[int]
    drafted: list[DraftedSequence] = field(default_factory=list)
    """Sequences verifying drafts (speculative decoding): their d + 1 rows each are the rest of
    sample_indices, in this order."""
    lora: LoRABatch | None = None
    """Row runs -> adapter slots (None: every row on the base model)."""
    prompt_scorings: list[PromptScoring] = field(default_factory=list)
    """The chunks whose rows score prompt tokens (prompt_logprobs), in `prompt_rows` order."""
    prompt_rows: torch.Tensor | None = None
    """[S] int64: the flattened rows scoring prompt tokens (None: none this step)."""
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    """Filled by `ModelRunner.compute_logits`: seq_id -> its chunk's prompt-token scores."""
    step: StepInput | None = None
    """The host data this batch was built from (what the other tensor-parallel ranks get)."""
    image_slices: list[ImageSlice] = field(default_factory=list)
    """The image placeholder rows of the step, by image (execution/mm_embeds.py)."""
    row_features: list[Seq[MultiModalFeature]] = field(default_factory=list)
    """Per sequence in row order, its prompt's images (empty when no sequence has any): what
    M-RoPE positions are computed from."""


def row_layout(
    scheduled: list[ScheduledSequence], lora_slots: Mapping[int, int] | None = None
) -> list[ScheduledSequence]:
    """The order of a step's sequences in the flattened batch: decodes first, longest context
    first, then longer chunks. The CPU attention then takes each group of similar-length decodes
    as a slice of consecutive rows (no gather of q, no scatter of the output). With adapters
    (`lora_slots`: lora_int_id -> slot), decodes and chunks are each grouped by slot first (base
    model first), so each adapter's rows form few runs for the batched LoRA kernel."""
    slot_of = lora_slots or {}
    return sorted(
        scheduled,
        key=lambda s: (
            s.num_new_tokens > 1,
            slot_of.get(s.seq.lora_int_id, -1),
            -(s.seq.num_computed_tokens + s.num_new_tokens),
        ),
    )


def _prompt_rows(
    scheduled: list[ScheduledSequence], layout: list[ScheduledSequence], q_lens: np.ndarray
) -> tuple[list[int], list[PromptScoring]]:
    """The flattened rows of chunks that score prompt tokens (prompt_logprobs), scheduled order,
    and those chunks' scorings."""
    first_row = {id(s): int(r) for s, r in zip(layout, np.cumsum(q_lens) - q_lens, strict=True)}
    rows: list[int] = []
    scorings: list[PromptScoring] = []
    for s in scheduled:
        scoring = prompt_scoring(s)
        if scoring is None:
            continue
        # The row at position p scores token p + 1: the chunk's rows from its first one on.
        first = first_row[id(s)]
        rows += range(first, first + len(scoring.token_ids))
        scorings.append(scoring)
    return rows, scorings


@dataclass
class _SamplingPlan:
    """Rank 0's sampling rows of a step, scheduled order."""

    rows: list[SamplingRow] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    drafted: list[DraftedSequence] = field(default_factory=list)
    drafted_indices: list[int] = field(default_factory=list)


class StepBatcher:
    """Flattens scheduled sequences into device batches for one model and KV pool."""

    def __init__(
        self,
        device: torch.device,
        block_size: int,
        ops: KernelOps,
        lora: RunnerLoRA,
        layer_cache: torch.Tensor | None = None,
    ):
        """`layer_cache`: one layer's KV cache, what the kernels' attention planner reads
        (set once the pool exists)."""
        self.device, self.block_size, self.ops, self.lora = device, block_size, ops, lora
        self.layer_cache = layer_cache

    def prepare_input(
        self, scheduled: list[ScheduledSequence], num_samples: Mapping[int, int] | None = None
    ) -> ModelInput:
        """Flatten ScheduledSequences (seq, num_new_tokens) into one device batch; a sequence
        sampled k times (`num_samples`: seq_id -> k, default 1) repeats its row k times."""
        requests = [s.seq.lora_request for s in scheduled if s.seq.lora_request is not None]
        slot_of = self.lora.activate(requests)
        # Sampling rows (and so the logits rows) keep the scheduled order; token rows do not.
        layout = row_layout(scheduled, slot_of)
        step, plan = self._host_step(scheduled, layout, num_samples or {})
        if requests:
            adapters = [(r.lora_int_id, r.lora_name, r.lora_path) for r in requests]
            step = replace(step, lora=LoRAStep(adapters, [s.seq.lora_int_id for s in layout]))
        features = [() if s.seq.request is None else s.seq.request.mm_features for s in layout]
        slices, limits = [], None
        if any(features):
            starts, lens = step.starts.tolist(), step.q_lens.tolist()
            slices = image_slices(features, starts, lens)
            limits = visible_until(slices, starts, lens)
        batch = self.device_input(step, plan.rows, plan.seq_ids, slot_of, limits)
        batch.drafted = plan.drafted
        if any(features):  # M-RoPE positions need them in decode steps too
            batch.row_features, batch.image_slices = features, slices
        return batch

    def _host_step(
        self,
        scheduled: list[ScheduledSequence],
        layout: list[ScheduledSequence],
        num_samples: Mapping[int, int],
    ) -> tuple[StepInput, _SamplingPlan]:
        """The step's host data, and its sampling rows (rank 0's alone)."""
        starts = np.array([s.seq.num_computed_tokens for s in layout], dtype=np.int64)
        q_lens = np.array([s.num_new_tokens for s in layout], dtype=np.int64)
        tokens: list[int] = []
        for s in layout:
            tokens += s.input_token_ids
        last_row = {id(s): int(end) - 1 for s, end in zip(layout, np.cumsum(q_lens), strict=True)}
        plan = _SamplingPlan()
        for s in scheduled:
            if s.samples:
                self._plan_samples(plan, s, last_row[id(s)], num_samples.get(s.seq.seq_id, 1))
        prompt_rows, scorings = _prompt_rows(scheduled, layout, q_lens)
        step = StepInput(
            np.array(tokens, dtype=np.int64),
            starts,
            q_lens,
            [s.seq.block_table for s in layout],
            plan.indices + plan.drafted_indices,
            prompt_rows,
            scorings,
        )
        return step, plan

    def _plan_samples(self, plan: _SamplingPlan, s: ScheduledSequence, last: int, k: int) -> None:
        row = self._sampling_row(s.seq)
        if s.spec_token_ids:  # its d + 1 rows go after every plain sample's
            plan.drafted.append(drafted_sequence(s, row))
            plan.drafted_indices += range(last - len(s.spec_token_ids), last + 1)
            return
        plan.rows += [row] * k
        plan.seq_ids += [s.seq.seq_id] * k
        plan.indices += [last] * k

    def device_input(
        self,
        step: StepInput,
        rows: list[SamplingRow] | None = None,
        seq_ids: list[int] | None = None,
        slot_of: Mapping[int, int] | None = None,
        limits: np.ndarray | None = None,
    ) -> ModelInput:
        """`step` as a device batch (with its sampling rows on rank 0; none on the others).
        `slot_of`: rank 0's adapter slots (lora_int_id -> slot); the other ranks activate the
        step's adapters themselves, in rank 0's order, so their slots are the same. `limits`:
        the rows' `AttentionMetadata.visible_until` (None: causal)."""
        batch = self.flat_input(
            step.tokens, step.starts, step.q_lens, step.block_tables, step.sample_indices
        )
        batch.sample_rows, batch.sample_seq_ids, batch.step = rows or [], seq_ids or [], step
        if step.lora is not None:
            if slot_of is None:
                slot_of = self.lora.activate(self.lora.rank_requests(step.lora))
            segments = lora_segments(
                [slot_of.get(i, -1) for i in step.lora.row_ids], self.device, step.q_lens.tolist()
            )
            if segments is not None:
                batch.lora = LoRABatch(self.lora.slots, segments, self.ops)
        if step.prompt_rows:
            batch.prompt_rows = torch.tensor(step.prompt_rows, dtype=torch.long).to(self.device)
            batch.prompt_scorings = list(step.prompt_scorings)
        meta = batch.meta
        limit_kw = {}
        if limits is not None:
            meta.visible_until = torch.from_numpy(limits).to(self.device)
            limit_kw = {"visible_until": meta.visible_until}
        if self.ops.plan_attention is not None:
            meta.plan = self.ops.plan_attention(
                meta.query_start_loc, meta.seq_lens, meta.block_tables, self.layer_cache, **limit_kw
            )
        return batch

    def flat_input(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        q_lens: np.ndarray,
        block_tables: list[list[int]],
        sample_indices: list[int],
    ) -> ModelInput:
        """The device tensors of a flattened batch, with no sampling rows yet."""
        flat = flat_batch(
            tokens, starts, q_lens, block_tables, sample_indices, self.block_size, self.device
        )
        return ModelInput(flat.input_ids, flat.positions, flat.meta, flat.sample_indices, [], [])

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.sampling_params
        if params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(params.seed)
        return SamplingRow(params, seq.token_ids, seq.num_prompt_tokens, seq.generator)
