"""Verification of a step's draft tokens on the target model's logits. The proposers run before
the step (engine/drafter.py), the scheduler schedules the drafts, the runner hands back the
drafted rows' logits (`ModelOutput.draft_logits`) and `verify_drafts` turns them into tokens.

A sequence that drafted d tokens x_0 .. x_{d-1} after its last token computes d + 1 positions in
the step; the logits row at position i gives the target's distribution p_i for the token after
x_{i-1} (p_0 after the last token). Each row goes through the sampler's own pipeline (min_tokens,
penalties, temperature, top-k/top-p/min-p) with the history it would have if the drafts before it
were accepted, so an accepted run is distributed exactly as plain decoding (rejection_sampler.py)
and, greedy, is token for token the plain greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.llm.core.sampling_params import SAMPLING_EPS
from backend_lib.llm.execution.sampler import RawLogprobs, Sampler, SamplingRow, TokenLogprobs
from backend_lib.llm.execution.step_batch import DraftedSequence
from backend_lib.llm.execution.step_sampling import ModelOutput
from backend_lib.llm.spec_decode.rejection_sampler import RejectionSamplerInput, rejection_sample


@dataclass
class Verified:
    """What one drafted sequence emits this step."""

    token_ids: list[int]
    """The accepted drafts, then the corrected or bonus token: 1 .. d + 1 tokens."""
    logprobs: list[TokenLogprobs] | None
    """Per emitted token, from the raw logits at its position (None: the request asked none)."""
    num_drafts: int
    num_accepted: int


def verify_drafts(output: ModelOutput, sampler: Sampler) -> None:
    """Verify `output.draft_logits` (when set) into the output's `sampled`, `logprobs` and
    `drafts` entries. A constrained sequence whose accepted drafts lead its grammar to a dead end
    is one (as plain decoding would find at its next step)."""
    pending, output.draft_logits = output.draft_logits, None
    if pending is None:
        return
    with torch.inference_mode():
        verified = verify(pending.logits, pending.drafted, sampler)
    mask = output.bitmask
    for d, v in zip(pending.drafted, verified, strict=True):
        output.sampled[d.seq_id] = v.token_ids
        if v.logprobs is not None:
            output.logprobs[d.seq_id] = v.logprobs
        output.drafts[d.seq_id] = (v.num_drafts, v.num_accepted)
        dead_at = None if mask is None else mask.dead_after_drafts.get(d.seq_id)
        if dead_at is not None and v.num_accepted >= dead_at:
            mask.dead_seq_ids.append(d.seq_id)


def verify(
    logits: torch.Tensor, drafted: list[DraftedSequence], sampler: Sampler
) -> list[Verified]:
    """`logits` [sum(d + 1), V]: the drafted sequences' rows, in order. One rejection-sampling
    pass over all of them (draws from the sampler's generator, or a seeded row's own); when every
    row is greedy, the greedy rule directly on the rows' argmax (the same tokens, without the
    sampler's tensors: at one row per step of a small model those cost a visible share)."""
    rows = [r for d in drafted for r in d.rows]
    target, raw_logprobs = sampler.target_distribution(logits, rows)
    starts, offset = [], 0
    for d in drafted:
        starts.append(offset)
        offset += len(d.rows)
    if all(d.rows[0].params.temperature < SAMPLING_EPS for d in drafted):
        emitted = _greedy_runs(target.argmax(dim=-1).tolist(), drafted, starts)
    else:
        emitted = _rejection_sampled(target, drafted, starts, sampler.generator)
    logprobs = _emitted_logprobs(sampler, raw_logprobs, rows, drafted, starts, emitted)
    return [
        Verified(tokens, lps, len(d.draft_token_ids), len(tokens) - 1)
        for d, tokens, lps in zip(drafted, emitted, logprobs, strict=True)
    ]


def _greedy_runs(
    argmax: list[int], drafted: list[DraftedSequence], starts: list[int]
) -> list[list[int]]:
    """Greedy verification: the drafts while each equals the target's argmax at its position,
    then the argmax after the last accepted one (the corrected or bonus token)."""
    runs = []
    for d, start in zip(drafted, starts, strict=True):
        run = []
        for position, draft in enumerate(d.draft_token_ids):
            if argmax[start + position] != draft:
                break
            run.append(draft)
        run.append(argmax[start + len(run)])
        runs.append(run)
    return runs


def _rejection_sampled(
    target: torch.Tensor,
    drafted: list[DraftedSequence],
    starts: list[int],
    generator: torch.Generator,
) -> list[list[int]]:
    """Each sequence's emitted tokens by the rejection sampler (rejection_sampler.py)."""
    k = max(len(d.draft_token_ids) for d in drafted)
    index = torch.tensor(
        [
            [s + min(i, len(d.draft_token_ids)) for i in range(k + 1)]
            for s, d in zip(starts, drafted, strict=True)
        ],
        device=target.device,
    )
    result = rejection_sample(
        RejectionSamplerInput(
            draft_token_ids=torch.tensor(
                [d.draft_token_ids + [0] * (k - len(d.draft_token_ids)) for d in drafted],
                dtype=torch.int64,
                device=target.device,
            ),
            num_draft_tokens=[len(d.draft_token_ids) for d in drafted],
            draft_probs=None,  # deterministic drafts: n-gram lookup, the draft model's argmax
            target_probs=target[index],  # [B, k + 1, V]; positions past a row's bonus repeat it
            greedy=[d.rows[0].params.temperature < SAMPLING_EPS for d in drafted],
            generators=[d.rows[0].generator for d in drafted],
        ),
        generator,
    )
    return result.emitted_token_ids()


def _emitted_logprobs(
    sampler: Sampler,
    raw_logprobs: RawLogprobs,
    rows: list[SamplingRow],
    drafted: list[DraftedSequence],
    starts: list[int],
    emitted: list[list[int]],
) -> list[list[TokenLogprobs] | None]:
    """Each drafted sequence's logprobs of its emitted tokens (None where it asked none)."""
    if raw_logprobs is None:
        return [None] * len(drafted)
    tokens = [0] * len(rows)  # rows past a sequence's emitted tokens score token 0, unused
    for start, run in zip(starts, emitted, strict=True):
        tokens[start : start + len(run)] = run
    ids = torch.tensor(tokens, dtype=torch.int64, device=raw_logprobs[1].device)
    per_row = sampler.gather_logprobs(raw_logprobs, ids, rows)
    out: list[list[TokenLogprobs] | None] = []
    for start, run, d in zip(starts, emitted, drafted, strict=True):
        wanted = d.rows[0].params.logprobs is not None
        out.append(per_row[start : start + len(run)] if wanted else None)  # type: ignore[arg-type]
    return out
