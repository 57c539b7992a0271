"""Rejection sampler: distribution preservation, greedy verification, q == p, seeds, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from backend_lib.llm.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSamplerInput,
    rejection_sample,
)

CPU = torch.device("cpu")


def _dirichlet(*shape: int) -> torch.Tensor:
    """Random distributions over the last dim (flat Dirichlet), float32."""
    return torch.distributions.Dirichlet(torch.ones(shape[-1])).sample(shape[:-1])


def _batch(drafts, num_drafts, draft_probs, target, greedy=None, generators=None):
    rows = drafts.shape[0]
    return RejectionSamplerInput(
        draft_token_ids=drafts,
        num_draft_tokens=num_drafts,
        draft_probs=draft_probs,
        target_probs=target,
        greedy=[False] * rows if greedy is None else greedy,
        generators=[None] * rows if generators is None else generators,
    )


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    empirical = torch.bincount(samples, minlength=p.numel()).double() / samples.numel()
    return 0.5 * (empirical - p.double()).abs().sum().item()


def _tv_tolerance(p: torch.Tensor, n: int) -> float:
    """1e-2, or 3x the expected TV of n samples where n is too small for that:
    E|p_hat_v - p_v| ~ sqrt(2 p_v (1 - p_v) / (pi n)) by the normal approximation."""
    expected = 0.5 * torch.sqrt(2 * p * (1 - p) / (math.pi * n)).sum().item()
    return max(1e-2, 3 * expected)


# --- 1. distribution preservation ----------------------------------------------------------------


@pytest.mark.parametrize("deterministic_proposer", [False, True], ids=["draft_model", "ngram"])
def test_emitted_tokens_follow_the_target_distribution(deterministic_proposer: bool):
    torch.manual_seed(0)
    vocab, k, rows = 8, 3, 400_000
    # Two target/draft pairs, interleaved in blocks of k + 1 rows, so a mix-up between rows shows;
    # num_draft_tokens cycles 0..k inside each block, independently of the pair.
    p = _dirichlet(2, k + 1, vocab)
    q = _dirichlet(2, k, vocab)
    pair = (torch.arange(rows) // (k + 1)) % 2
    num_drafts = torch.arange(rows) % (k + 1)
    target = p[pair]
    if deterministic_proposer:
        # An n-gram proposer drafts one fixed continuation; draft_probs None means one-hot q.
        drafts, draft_probs = p[pair, :k].argmax(dim=-1), None
    else:
        draft_probs = q[pair]
        drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1).reshape(rows, k)
    torch.manual_seed(1)
    out = rejection_sample(_batch(drafts, num_drafts, draft_probs, target))

    assert torch.equal(out.num_accepted <= num_drafts, torch.ones(rows, dtype=torch.bool))
    for g in range(2):
        mine = pair == g
        first = out.token_ids[mine, 0]
        assert _tv(first, p[g, 0]) <= 1e-2
        # The token after an accepted x_0 is a correction, an accepted x_1, or (n == 1) the bonus.
        after = out.token_ids[mine & (out.num_accepted >= 1), 1]
        assert _tv(after, p[g, 1]) <= _tv_tolerance(p[g, 1], after.numel())
        # x_0 is accepted with probability sum_v min(p(v), q(v)) (q one-hot: p(x_0)).
        has_draft = mine & (num_drafts >= 1)
        rate = (out.num_accepted[has_draft] >= 1).double().mean().item()
        if deterministic_proposer:
            expected_rate = p[g, 0].max().item()
        else:
            expected_rate = torch.minimum(p[g, 0], q[g, 0]).sum().item()
        assert abs(rate - expected_rate) <= 1e-2


def test_residual_without_mass_falls_back_to_the_target():
    # q has more total mass than p, so p(x) / q(x) < 1 rejects sometimes, yet max(0, p - q) == 0.
    torch.manual_seed(0)
    rows, vocab = 50_000, 4
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.full((vocab,), 0.5)
    drafts = torch.multinomial(p, rows, replacement=True).unsqueeze(1)
    target = torch.stack([p, p]).expand(rows, 2, vocab)
    out = rejection_sample(_batch(drafts, [1] * rows, q.expand(rows, 1, vocab), target))
    rejected = out.num_accepted == 0
    assert 0 < int(rejected.sum()) < rows
    assert _tv(out.token_ids[rejected, 0], p) <= _tv_tolerance(p, int(rejected.sum()))


# --- 2. greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_accept_the_argmax_prefix_then_emit_one_token(with_draft_probs: bool):
    torch.manual_seed(0)
    vocab, k = 20, 4
    # Row r agrees with the argmax on its first `agree` drafts, then drafts something else.
    cases = [(n, agree) for n in range(k + 1) for agree in range(k + 1)]  # (num_drafts, agree)
    rows = len(cases)
    target = torch.randn(rows, k + 1, vocab).softmax(dim=-1)
    best = target.argmax(dim=-1)
    drafts = best[:, :k].clone()
    for r, (_, agree) in enumerate(cases):
        drafts[r, agree:] = (best[r, agree:k] + 1) % vocab
    num_drafts = [n for n, _ in cases]
    draft_probs = _dirichlet(rows, k, vocab) if with_draft_probs else None
    # Padding past num_draft_tokens may hold anything, even the placeholder.
    for r, n in enumerate(num_drafts):
        drafts[r, n:] = PLACEHOLDER_TOKEN_ID
    out = rejection_sample(_batch(drafts, num_drafts, draft_probs, target, greedy=[True] * rows))

    for r, (n, agree) in enumerate(cases):
        accepted = min(n, agree)
        assert out.num_accepted[r].item() == accepted
        emitted = best[r, : accepted + 1].tolist()  # the accepted drafts equal the argmax
        padding = [PLACEHOLDER_TOKEN_ID] * (k - accepted)
        assert out.token_ids[r].tolist() == emitted + padding
        assert out.emitted_token_ids()[r] == emitted
    all_accepted = [r for r, (n, agree) in enumerate(cases) if n == k and agree == k]
    assert out.num_emitted[all_accepted].tolist() == [k + 1] * len(all_accepted)
    zero_drafts = [r for r, (n, _) in enumerate(cases) if n == 0]
    assert out.token_ids[zero_drafts, 0].tolist() == best[zero_drafts, 0].tolist()


def test_greedy_rows_are_unaffected_by_sampling_rows_beside_them():
    torch.manual_seed(0)
    vocab, k, rows = 30, 3, 8
    target = torch.randn(rows, k + 1, vocab).softmax(dim=-1)
    drafts = target[:, :k].argmax(dim=-1)
    greedy = [r % 2 == 0 for r in range(rows)]
    out = rejection_sample(_batch(drafts, [k] * rows, _dirichlet(rows, k, vocab), target, greedy))
    best = target.argmax(dim=-1)
    assert out.token_ids[::2].tolist() == best[::2].tolist()
    assert out.num_accepted[::2].tolist() == [k] * (rows // 2)


# --- 3. q == p -----------------------------------------------------------------------------------


def test_a_draft_equal_to_the_target_is_always_accepted():
    torch.manual_seed(0)
    vocab, k, rows = 50, 4, 2_000
    target = _dirichlet(rows, k + 1, vocab)
    draft_probs = target[:, :k].clone()
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1).reshape(rows, k)
    num_drafts = torch.arange(rows) % (k + 1)
    out = rejection_sample(_batch(drafts, num_drafts, draft_probs, target))
    assert torch.equal(out.num_accepted, num_drafts)
    emitted = out.token_ids.gather(1, num_drafts.unsqueeze(1)).squeeze(1)
    assert bool(((emitted >= 0) & (emitted < vocab)).all())


# --- 4. seeds ------------------------------------------------------------------------------------


def test_a_seeded_row_is_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    vocab, k, steps = 50, 3, 6
    # The seeded row's inputs at each step: flatter targets than drafts, so it rejects often.
    mine = []
    for _ in range(steps):
        q = torch.randn(k, vocab).softmax(-1)
        mine.append(((torch.randn(k + 1, vocab) * 0.5).softmax(-1), q, torch.multinomial(q, 1).T))

    def run(position: int | None, batch_seed: int, seed: int = 1234) -> list[list[int]]:
        """Six steps of one seeded request; position None: alone in the batch."""
        generator = torch.Generator(CPU).manual_seed(seed)
        other_generator = torch.Generator(CPU).manual_seed(99)
        others = torch.Generator(CPU).manual_seed(batch_seed)
        emitted = []
        for p, q, drafts in mine:
            target, draft_probs = p.unsqueeze(0), q.unsqueeze(0)
            generators: list[torch.Generator | None] = [generator]
            greedy, num_drafts = [False], [k]
            if position is not None:
                n_other = 4
                o_target = _dirichlet(n_other, k + 1, vocab)
                o_q = _dirichlet(n_other, k, vocab)
                o_drafts = torch.randint(vocab, (n_other, k), generator=others)
                o_generators = [None, other_generator, None, None]
                o_greedy, o_num = [False, False, True, False], [3, 1, 2, 0]
                at = position
                target = torch.cat([o_target[:at], target, o_target[at:]])
                draft_probs = torch.cat([o_q[:at], draft_probs, o_q[at:]])
                drafts = torch.cat([o_drafts[:at], drafts, o_drafts[at:]])
                generators = o_generators[:at] + generators + o_generators[at:]
                greedy = o_greedy[:at] + greedy + o_greedy[at:]
                num_drafts = o_num[:at] + num_drafts + o_num[at:]
            torch.manual_seed(batch_seed)  # the default generator serves the unseeded rows
            out = rejection_sample(
                _batch(drafts, num_drafts, draft_probs, target, greedy, generators)
            )
            emitted.append(out.emitted_token_ids()[0 if position is None else position])
        return emitted

    alone = run(None, batch_seed=0)
    assert run(0, batch_seed=1) == alone
    assert run(2, batch_seed=2) == alone
    assert run(4, batch_seed=3) == alone
    # The seed, not the inputs alone, decides the tokens: another seed gives another stream.
    assert run(None, batch_seed=0, seed=4321) != alone


# --- 5. bad input --------------------------------------------------------------------------------


def _good_parts(rows=3, k=2, vocab=10):
    drafts = torch.randint(vocab, (rows, k))
    return drafts, [k] * rows, _dirichlet(rows, k, vocab), _dirichlet(rows, k + 1, vocab)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d, n, q, p: (d, n, q, p[:, :-1]), "target_probs must be"),
        (lambda d, n, q, p: (d[:-1], n[:-1], q[:-1], p), "target_probs must be"),
        (lambda d, n, q, p: (d, n, q[:, :, :-1], p), "draft_probs must be"),
        (lambda d, n, q, p: (d, [3, 0, 1], q, p), "num_draft_tokens must lie in 0..k"),
        (lambda d, n, q, p: (d, [1, -1, 1], q, p), "num_draft_tokens must lie in 0..k"),
        (lambda d, n, q, p: (d, n[:-1], q, p), "num_draft_tokens must have shape"),
        (lambda d, n, q, p: (d, n, q, p.double()), "target_probs must be float32"),
        (lambda d, n, q, p: (d, n, q.half(), p), "draft_probs must be float32"),
        (lambda d, n, q, p: (d.int(), n, q, p), "draft_token_ids must be int64"),
        (lambda d, n, q, p: (d + 100, n, q, p), "draft_token_ids must lie in"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_problem(breakage, message):
    torch.manual_seed(0)
    drafts, num_drafts, draft_probs, target = breakage(*_good_parts())
    rows = 3
    batch = RejectionSamplerInput(
        drafts, num_drafts, draft_probs, target, [False] * rows, [None] * rows
    )
    with pytest.raises(ValueError, match=message):
        rejection_sample(batch)


def test_generators_of_the_wrong_length_are_rejected():
    drafts, num_drafts, draft_probs, target = _good_parts()
    batch = RejectionSamplerInput(drafts, num_drafts, draft_probs, target, [False] * 3, [None])
    with pytest.raises(ValueError, match="generators must have B = 3"):
        rejection_sample(batch)
