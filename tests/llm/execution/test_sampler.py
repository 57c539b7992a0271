"""Sampler: greedy, seeded reproducibility, truncation supports, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.execution.sampler import Sampler, SamplingRow, apply_penalties

CPU = torch.device("cpu")
EOS = 3


def _row(prompt=(5, 6), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(
        SamplingParams(**params), list(prompt) + list(output), len(prompt), generator
    )


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator(CPU).manual_seed(seed)


def _draws(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """n independent samples from one logits row (n identical rows in one batch)."""
    rows = [_row(**params) for _ in range(n)]
    return torch.tensor(Sampler([EOS], CPU, seed)(logits_row.expand(n, -1), rows).token_ids)


def test_greedy_rows_take_argmax_even_beside_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rows = [_row(temperature=0.0) if i % 2 == 0 else _row(temperature=1.0) for i in range(6)]
    out = Sampler([EOS], CPU)(logits, rows).token_ids
    assert out[::2] == logits.argmax(-1)[::2].tolist()


def test_seeded_row_is_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    mine = [torch.randn(100) for _ in range(6)]  # the seeded row's logits at each step
    theirs = [torch.randn(4, 100) for _ in range(6)]

    def run(seed: int, position: int | None, sampler_seed: int) -> list[int]:
        """Sample 6 steps for one seeded request; position None: alone in the batch."""
        generator = _seeded(seed)
        others = [
            _row(temperature=0.9),
            _row(temperature=1.2, seed=99, generator=_seeded(99)),
            _row(temperature=0.0),
            _row(temperature=0.7, top_k=20),
        ]
        sampler = Sampler([EOS], CPU, sampler_seed)
        tokens = []
        for own, other in zip(mine, theirs, strict=True):
            row = _row(temperature=1.0, top_p=0.9, seed=seed, generator=generator)
            if position is None:
                tokens += sampler(own[None], [row]).token_ids
                continue
            logits = torch.cat([other[:position], own[None], other[position:]])
            tokens.append(
                sampler(logits, others[:position] + [row] + others[position:]).token_ids[position]
            )
        return tokens

    alone = run(seed=1234, position=None, sampler_seed=0)
    assert run(seed=1234, position=0, sampler_seed=7) == alone
    assert run(seed=1234, position=3, sampler_seed=8) == alone
    assert run(seed=4321, position=None, sampler_seed=0) != alone


def test_top_k_support_is_the_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(64)
    samples = _draws(logits, 4000, top_k=5)
    assert set(samples.tolist()) == set(logits.topk(5).indices.tolist())
    assert set(_draws(logits, 50, top_k=1).tolist()) == {int(logits.argmax())}


@pytest.mark.parametrize(("top_p", "support"), [(0.75, {0, 1}), (0.85, {0, 1, 2}), (0.4, {0})])
def test_top_p_keeps_the_smallest_nucleus(top_p, support):
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    samples = _draws(probs.log(), 4000, top_p=top_p)
    assert set(samples.tolist()) == support
    kept = torch.tensor(sorted(support))
    expected = probs[kept] / probs[kept].sum()
    freq = torch.stack([(samples == t).float().mean() for t in kept])
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_min_p_drops_tokens_below_the_scaled_floor():
    probs = torch.tensor([0.4, 0.3, 0.1, 0.08, 0.07, 0.05])
    assert set(_draws(probs.log(), 3000, min_p=0.22).tolist()) == {0, 1, 2}  # floor 0.088


def test_random_draws_follow_softmax_with_temperature():
    torch.manual_seed(2)
    logits = torch.randn(8)
    n = 20000
    samples = _draws(logits, n, seed=3, temperature=0.7)
    freq = torch.bincount(samples, minlength=8).float() / n
    expected = torch.softmax(logits / 0.7, -1)
    # 6 binomial standard deviations at most: deterministic here (seeded), and not a loose bound.
    bound = 6 * (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= bound).all(), (freq, expected)


def test_penalties_match_reference():
    torch.manual_seed(3)
    vocab = 40
    cases = [
        dict(prompt=[1, 2, 2, 9], output=[9, 9, 4, 30], repetition_penalty=1.3),
        dict(prompt=[7], output=[7, 8, 8, 8, 12], frequency_penalty=0.4, presence_penalty=0.25),
        dict(
            prompt=[0, 5, 5],
            output=[5, 6],
            repetition_penalty=0.8,
            frequency_penalty=-0.3,
            presence_penalty=0.5,
        ),
        dict(prompt=[3, 4], output=[]),
    ]
    logits = torch.randn(len(cases), vocab) * 3
    rows = [_row(**c) for c in cases]
    got = logits.clone()
    apply_penalties(got, rows)
    for i, c in enumerate(cases):
        ref = logits[i : i + 1].clone()
        ids = torch.tensor([c["prompt"] + c["output"]])
        ref = RepetitionPenaltyLogitsProcessor(c.get("repetition_penalty", 1.0))(ids, ref)[0]
        for token in set(c["output"]):  # OpenAI/vLLM: output tokens only
            count = c["output"].count(token)
            ref[token] -= c.get("frequency_penalty", 0.0) * count + c.get("presence_penalty", 0.0)
        torch.testing.assert_close(got[i], ref, atol=1e-6, rtol=1e-6)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    logits[:, 7] = 8.0
    rows = [
        _row(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=[5]),
        _row(output=[1, 2], temperature=0.0, min_tokens=2, stop_token_ids=[5]),
        _row(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True),
        _row(output=[], temperature=1.0, min_tokens=1, stop_token_ids=[5]),
    ]
    out = Sampler([EOS], CPU)(logits, rows).token_ids
    assert out[:3] == [7, EOS, EOS]
    assert out[3] not in (EOS, 5)


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    rows = [
        _row(
            output=[4, 4],
            temperature=0.8,
            repetition_penalty=1.5,
            logprobs=4,
            seed=1,
            generator=_seeded(1),
        ),
        _row(temperature=0.0, logprobs=0),
        _row(temperature=0.0),
    ]
    out = Sampler([EOS], CPU)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i in (0, 1):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert math.isclose(lp.logprob, raw[i, token].item(), abs_tol=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        k = rows[i].params.logprobs
        assert lp.top_token_ids == raw[i].topk(k).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), raw[i].topk(k).values)
    assert out.logprobs[2] is None
