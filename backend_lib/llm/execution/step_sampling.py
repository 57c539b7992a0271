"""A step's logits -> its `ModelOutput`: the structured-output bitmask applied to the constrained
rows, the plain rows sampled (k per sequence for parallel sampling), and the drafted rows handed
on, masked, for verification above the runner (spec_decode/verifier.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend_lib.llm.execution.prompt_logprobs import PromptLogprobsChunk
from backend_lib.llm.execution.sampler import Sampler, TokenLogprobs
from backend_lib.llm.execution.step_batch import DraftedSequence, ModelInput
from backend_lib.llm.structured.manager import BitmaskBatch, BitmaskJob
from kernels import KernelOps


@dataclass
class DraftLogits:
    """The target's logits at the rows of the sequences verifying drafts."""

    logits: torch.Tensor
    """[sum(d + 1), V] float32, drafted sequence after drafted sequence, the bitmask applied."""
    drafted: list[DraftedSequence]


@dataclass
class ModelOutput:
    sampled: dict[int, list[int]] = field(default_factory=dict)
    """seq_id -> sampled tokens (one, or k when num_samples asked for k), for sampling seqs only."""
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """seq_id -> logprobs of each sampled token, for seqs whose params.logprobs is not None."""
    bitmask: BitmaskBatch | None = None
    """The structured-output bitmask applied this step (None: no constrained row)."""
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    """seq_id -> the prompt tokens its chunk scored, for seqs whose params.prompt_logprobs is set."""
    drafts: dict[int, tuple[int, int]] = field(default_factory=dict)
    """seq_id -> (drafts verified, drafts accepted) for sequences that verified drafts; their
    `sampled` entry holds the accepted drafts plus one token."""
    draft_logits: DraftLogits | None = None
    """Rows still to verify (None: none, or verified): `spec_decode.verifier.verify_drafts` turns
    them into `sampled`, `logprobs` and `drafts` entries."""


def sample_step(
    logits: torch.Tensor,
    batch: ModelInput,
    sampler: Sampler,
    ops: KernelOps,
    bitmask_job: BitmaskJob | None,
) -> ModelOutput:
    """`logits` [R, V]: the batch's sampling rows (plain samples, then drafted rows)."""
    output = ModelOutput(prompt_logprobs=batch.prompt_logprobs)
    if bitmask_job is not None:
        output.bitmask = mask = bitmask_job.result()
        with torch.inference_mode():
            ops.apply_token_bitmask(
                logits, mask.bitmask.to(logits.device), mask.rows.to(logits.device)
            )
    num_plain = len(batch.sample_rows)
    if batch.drafted:
        output.draft_logits = DraftLogits(logits[num_plain:], batch.drafted)
    if not batch.sample_rows:  # only non-final prefill chunks (or drafted decodes) this step
        return output
    with torch.inference_mode():
        result = sampler(logits[:num_plain], batch.sample_rows)
    for seq_id, token, logprob in zip(
        batch.sample_seq_ids, result.token_ids, result.logprobs, strict=True
    ):
        output.sampled.setdefault(seq_id, []).append(token)
        if logprob is not None:
            output.logprobs.setdefault(seq_id, []).append(logprob)
    return output
