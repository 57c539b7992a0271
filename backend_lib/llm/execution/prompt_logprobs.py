"""Prompt logprobs (vLLM's `prompt_logprobs`): how likely the model found each prompt token.

The logits at position p score the token at p + 1, so a prefill chunk covering positions
[start, end) scores prompt tokens start + 1 .. min(end, P - 1) (P: prompt length; the last
prompt position scores the first *generated* token, which is sampling's business). Chunks of one
prompt score disjoint ranges, so chunked prefill yields every position exactly once; a
recomputed prompt (preemption) scores its positions again, and the engine keeps the first.
Values come from the raw logits (log-softmax in float32), as the sampler's logprobs do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend_lib.llm.core.scheduler import ScheduledSequence
from backend_lib.llm.execution.sampler import TokenLogprobs

ROWS_PER_SLICE = 256
"""Prompt rows projected to logits at once: bounds the [rows, vocab] float32 working set."""


@dataclass
class PromptScoring:
    """The rows of one scheduled chunk that score prompt tokens."""

    seq_id: int
    first_token: int
    """Prompt index of the first token scored (its logits come from the row before it)."""
    token_ids: list[int]
    """The prompt tokens scored, in order."""
    num_top: int
    """The request's prompt_logprobs: top tokens reported per position."""


@dataclass
class PromptLogprobsChunk:
    """One chunk's scores: entry i is prompt token `first_token + i`."""

    first_token: int
    entries: list[TokenLogprobs]


def prompt_scoring(item: ScheduledSequence) -> PromptScoring | None:
    """What `item`'s chunk scores (None: the request asked for no prompt logprobs, or the chunk
    holds only the last prompt position or generated tokens)."""
    seq = item.seq
    num_top = seq.sampling_params.prompt_logprobs
    if num_top is None:
        return None
    start = item.start_position
    last = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
    if last <= start:
        return None
    return PromptScoring(seq.seq_id, start + 1, seq.token_ids[start + 1 : last + 1], num_top)


def score_prompts(
    hidden: torch.Tensor,
    scorings: list[PromptScoring],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, PromptLogprobsChunk]:
    """hidden [sum of len(token_ids), hidden_size]: the scoring rows' final states, in the order
    of `scorings` -> seq_id -> its chunk's logprobs. `compute_logits`: [R, hidden] -> float32
    [R, vocab]."""
    targets = torch.tensor(
        [t for s in scorings for t in s.token_ids], dtype=torch.long, device=hidden.device
    )
    num_top = max(s.num_top for s in scorings)
    token_lp, ranks, top_lp, top_ids = [], [], [], []
    for begin in range(0, len(targets), ROWS_PER_SLICE):
        rows = slice(begin, begin + ROWS_PER_SLICE)
        logprobs = torch.log_softmax(compute_logits(hidden[rows]), dim=-1)
        chosen = logprobs.gather(1, targets[rows].unsqueeze(1))
        token_lp.append(chosen.squeeze(1))
        ranks.append((logprobs > chosen).sum(dim=-1) + 1)
        top = logprobs.topk(num_top, dim=-1)
        top_lp.append(top.values)
        top_ids.append(top.indices)
    # One device->host transfer per tensor, then plain Python.
    lp_l, rank_l = torch.cat(token_lp).tolist(), torch.cat(ranks).tolist()
    top_lp_l, top_ids_l = torch.cat(top_lp).tolist(), torch.cat(top_ids).tolist()
    result, row = {}, 0
    for s in scorings:
        entries = []
        for token in s.token_ids:
            entries.append(
                TokenLogprobs(
                    token,
                    lp_l[row],
                    rank_l[row],
                    top_ids_l[row][: s.num_top],
                    top_lp_l[row][: s.num_top],
                )
            )
            row += 1
        result[s.seq_id] = PromptLogprobsChunk(s.first_token, entries)
    return result
