"""The runner's verification of drafts (verifier.py) on synthetic logits: the greedy shortcut and
the rejection sampler emit the same runs; each verified row is processed with the history its
earlier drafts give it (penalties see them), as the plain sampler would process that row."""

from __future__ import annotations

import torch

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.execution.sampler import Sampler, SamplingRow
from backend_lib.llm.execution.step_batch import DraftedSequence
from backend_lib.llm.spec_decode.verifier import verify

VOCAB = 50


def _drafted(seq_id: int, history: list[int], drafts: list[int], params) -> DraftedSequence:
    rows = [SamplingRow(params, history + drafts[:i], 2) for i in range(len(drafts) + 1)]
    return DraftedSequence(seq_id, drafts, rows)


def _batch(params, seed: int) -> tuple[torch.Tensor, list[DraftedSequence]]:
    """Random logits; each sequence's drafts agree with the argmax for a random prefix, then not."""
    gen = torch.Generator().manual_seed(seed)
    drafted, blocks = [], []
    for seq_id, num_drafts in enumerate((1, 3, 4, 2, 4)):
        logits = torch.randn(num_drafts + 1, VOCAB, generator=gen)
        best = logits.argmax(-1).tolist()
        agree = int(torch.randint(0, num_drafts + 1, (1,), generator=gen))
        drafts = [best[i] if i < agree else (best[i] + 1) % VOCAB for i in range(num_drafts)]
        drafted.append(_drafted(seq_id, [3, 4, 5], drafts, params))
        blocks.append(logits)
    return torch.cat(blocks), drafted


def test_greedy_shortcut_emits_what_the_rejection_sampler_emits():
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    for seed in range(20):
        logits, drafted = _batch(greedy, seed)
        fast = verify(logits, drafted, Sampler([], torch.device("cpu")))
        # One more sequence that samples sends the whole batch through the rejection sampler.
        sampled = _drafted(99, [3], [7], SamplingParams(temperature=1.0, max_tokens=10))
        mixed = verify(
            torch.cat((logits, torch.randn(2, VOCAB))),
            [*drafted, sampled],
            Sampler([], torch.device("cpu")),
        )
        assert [v.token_ids for v in fast] == [v.token_ids for v in mixed[:-1]]
        blocks = logits.split([len(d.rows) for d in drafted])
        for v, d, row_logits in zip(fast, drafted, blocks, strict=True):
            best = row_logits.argmax(-1).tolist()
            a = v.num_accepted
            assert v.token_ids == d.draft_token_ids[:a] + [best[a]]
            assert a == len(d.draft_token_ids) or d.draft_token_ids[a] != best[a]


def test_each_row_is_penalised_with_the_drafts_before_it():
    """Token 9 leads every row, the second by a hair; a repetition penalty on the row after a
    draft of 9 turns 9 down there: the first draft (9) is accepted, the second (9) is not."""
    params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=2.0)
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 2.0
    logits[:, 4] = 1.5
    (v,) = verify(logits, [_drafted(0, [3, 5], [9, 9], params)], Sampler([], torch.device("cpu")))
    assert v.token_ids == [9, 4] and v.num_accepted == 1
    plain = Sampler([], torch.device("cpu"))(logits[1:2], [SamplingRow(params, [3, 5, 9], 2)])
    assert plain.token_ids == [4]  # the plain sampler with that history picks the same token
