"""Rejection sampler of speculative decoding: verifies draft tokens against the target model.

For each of B rows, a proposer drafted `n_b` tokens x_0 .. x_{n_b - 1} (0 <= n_b <= k) with draft
distributions q_i (one-hot on x_i when the proposer is deterministic, as n-gram prompt lookup),
and the target model scored them in one forward, giving p_0 .. p_{n_b} (p_{n_b} is the bonus
position, after the last draft). The rule (vLLM v1's RejectionSampler; Leviathan et al. 2023,
Chen et al. 2023), for each row:

1. For i = 0, 1, ..., n_b - 1 while every earlier draft was accepted: accept x_i with probability
   min(1, p_i(x_i) / q_i(x_i)), i.e. when u_i < p_i(x_i) / q_i(x_i) for u_i ~ U[0, 1).
   Greedy rows (temperature 0) instead accept x_i while x_i == argmax p_i.
2. At the first rejection, at position j, emit one token from norm(max(0, p_j - q_j)) (greedy: the
   argmax of p_j) and stop. If max(0, p_j - q_j) has no mass (only rounding, or a q with more
   total mass than p, can cause that) sample p_j instead.
3. If all n_b drafts were accepted, emit a bonus token from p_{n_b} (greedy: its argmax).

So a row emits num_accepted + 1 tokens: the accepted drafts, then one corrected or bonus token.
Sampling rows emit tokens distributed exactly as sampling the target model token by token;
greedy rows emit exactly the target's greedy continuation.

Random draws. Each row needs its n_b uniforms u_i and one categorical draw, made with the
exponential race `argmax(w / E)`, E ~ Exp(1) i.i.d. over the vocabulary, which picks token v with
probability w_v / sum(w) (as the sampler's, execution/sampler.py; w need not be normalised). One E
per row serves both the corrected and the bonus token: a row emits only one of them, at the
position its uniforms chose, and the uniforms are independent of E. Unseeded rows draw from the
caller's generator (torch's default when None) in one batched call; a seeded sampling row then
draws from its own generator, in this fixed order: `torch.rand(n_b)`, then V exponentials. Its
draws thus depend only on its seed, its own n_b and the vocabulary size, never on the rest of the
batch. Greedy rows draw nothing from their own generators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1
"""Pads `RejectionSamplerOutput.token_ids` after each row's emitted tokens (as vLLM's)."""


@dataclass
class RejectionSamplerInput:
    """One verification step for B rows with up to k draft tokens each, over a vocabulary of V."""

    draft_token_ids: torch.Tensor
    """int64 [B, k]: each row's drafts, left-aligned; entries at or past num_draft_tokens are
    padding (any value)."""
    num_draft_tokens: Sequence[int] | torch.Tensor
    """[B] ints (list or int64 tensor) in 0..k: drafts in each row; 0 is plain decoding (only the
    bonus token)."""
    draft_probs: torch.Tensor | None
    """float32 [B, k, V]: the draft distribution q_i that x_i was sampled from; None for a
    deterministic proposer (n-gram), meaning q_i is one-hot on x_i: x_i is then accepted with
    probability p_i(x_i) and the corrected token comes from p_i without x_i, renormalised."""
    target_probs: torch.Tensor
    """float32 [B, k + 1, V]: the target's distribution p_i at each draft position and at the
    bonus position (row b's bonus is at index num_draft_tokens[b]), already processed by the
    caller's temperature / top-k / top-p. Greedy rows use only its argmax, so softmax(logits)
    (any monotone transform of the target logits) serves for them."""
    greedy: Sequence[bool] | torch.Tensor
    """[B] bools (list or bool tensor): rows sampled at temperature 0."""
    generators: Sequence[torch.Generator | None]
    """[B]: per-request generators of seeded rows (on target_probs' device); None for unseeded."""


@dataclass
class RejectionSamplerOutput:
    token_ids: torch.Tensor
    """int64 [B, k + 1]: each row's emitted tokens (accepted drafts, then the corrected or bonus
    token), left-aligned and padded with PLACEHOLDER_TOKEN_ID."""
    num_accepted: torch.Tensor
    """int64 [B]: drafts accepted per row, 0..num_draft_tokens; the row emits num_accepted + 1."""

    @property
    def num_emitted(self) -> torch.Tensor:
        """int64 [B]: tokens emitted per row (num_accepted + 1)."""
        return self.num_accepted + 1

    def emitted_token_ids(self) -> list[list[int]]:
        """Each row's emitted tokens as a Python list (one device->host transfer per tensor)."""
        counts = self.num_emitted.tolist()
        return [row[:n] for row, n in zip(self.token_ids.tolist(), counts, strict=True)]


def rejection_sample(
    batch: RejectionSamplerInput, generator: torch.Generator | None = None
) -> RejectionSamplerOutput:
    """Applies the module's rule to every row; `generator` serves the unseeded sampling rows."""
    num_drafts, greedy = _check(batch)
    target = batch.target_probs
    num_rows, k = batch.draft_token_ids.shape
    dev = target.device
    valid = torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)  # [B, k]
    # Padding may hold any value (even -1): point it at token 0 so gathers stay in range.
    drafts = torch.where(valid, batch.draft_token_ids.to(dev), 0)
    target_argmax = target.argmax(dim=-1)  # [B, k + 1]
    accepted = drafts == target_argmax[:, :k]
    sampling = ~greedy
    uniforms = exp_noise = None
    if bool(sampling.any()):
        uniforms, exp_noise = _draws(batch, num_drafts, sampling, generator)
        p_draft = target[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_draft = _draft_prob_of_drafts(batch.draft_probs, drafts)
        # u < p / q without dividing: q == 0 (a draft q could not have proposed) accepts when
        # p > 0; p == 0 never accepts.
        accepted = torch.where(sampling.unsqueeze(1), uniforms * q_draft < p_draft, accepted)
    accepted &= valid
    # Accepted drafts count only up to the first rejection.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(num_rows, device=dev)
    final = target_argmax[rows, num_accepted]
    if exp_noise is not None:
        weights = _final_weights(batch, drafts, num_accepted, num_drafts)
        sampled = weights.div_(exp_noise).argmax(dim=-1)
        final = torch.where(sampling, sampled, final)
    return RejectionSamplerOutput(_emitted(drafts, num_accepted, final), num_accepted)


def _check(batch: RejectionSamplerInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Raises ValueError on malformed input; returns num_draft_tokens (int64) and greedy (bool),
    both [B] tensors on target_probs' device."""
    drafts, target, q = batch.draft_token_ids, batch.target_probs, batch.draft_probs
    if drafts.dim() != 2 or drafts.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids must be int64 [B, k], got {drafts.dtype} {tuple(drafts.shape)}"
        )
    num_rows, k = drafts.shape
    if target.dtype != torch.float32:
        raise ValueError(f"target_probs must be float32, got {target.dtype}")
    if target.dim() != 3 or tuple(target.shape[:2]) != (num_rows, k + 1):
        raise ValueError(
            f"target_probs must be [B, k + 1, V] = [{num_rows}, {k + 1}, V] for draft_token_ids "
            f"{tuple(drafts.shape)}, got {tuple(target.shape)}"
        )
    vocab = target.shape[2]
    if q is not None:
        if q.dtype != torch.float32:
            raise ValueError(f"draft_probs must be float32, got {q.dtype}")
        if tuple(q.shape) != (num_rows, k, vocab):
            raise ValueError(
                f"draft_probs must be [B, k, V] = [{num_rows}, {k}, {vocab}], got {tuple(q.shape)}"
            )
    dev = target.device
    num_drafts = torch.as_tensor(batch.num_draft_tokens, dtype=torch.int64, device=dev)
    greedy = torch.as_tensor(batch.greedy, dtype=torch.bool, device=dev)
    for name, t in (("num_draft_tokens", num_drafts), ("greedy", greedy)):
        if tuple(t.shape) != (num_rows,):
            raise ValueError(f"{name} must have shape [B] = [{num_rows}], got {tuple(t.shape)}")
    if len(batch.generators) != num_rows:
        raise ValueError(
            f"generators must have B = {num_rows} entries, got {len(batch.generators)}"
        )
    if num_rows and not bool(((num_drafts >= 0) & (num_drafts <= k)).all()):
        raise ValueError(f"num_draft_tokens must lie in 0..k = 0..{k}, got {num_drafts.tolist()}")
    valid = torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
    live = drafts.to(dev)[valid]
    if live.numel() and not bool(((live >= 0) & (live < vocab)).all()):
        raise ValueError(f"draft_token_ids must lie in 0..V - 1 = 0..{vocab - 1}")
    return num_drafts, greedy


def _draws(
    batch: RejectionSamplerInput,
    num_drafts: torch.Tensor,
    sampling: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, k] and Exp(1) noise [B, V] (float32): batched from `generator`, then each
    seeded sampling row's own, drawn in the module's fixed order."""
    target = batch.target_probs
    num_rows, k = batch.draft_token_ids.shape
    vocab, dev = target.shape[2], target.device
    uniforms = torch.rand(num_rows, k, generator=generator, device=dev)
    exp_noise = torch.empty(num_rows, vocab, device=dev).exponential_(generator=generator)
    seeded = [i for i, g in enumerate(batch.generators) if g is not None]
    if seeded:
        counts, is_sampling = num_drafts.tolist(), sampling.tolist()
        for i in seeded:
            if not is_sampling[i]:
                continue
            own = batch.generators[i]
            uniforms[i, : counts[i]] = torch.rand(counts[i], generator=own, device=dev)
            exp_noise[i].exponential_(generator=own)
    # E == 0 would turn w / E into inf (or NaN for w == 0); the clamp changes nothing else.
    return uniforms, exp_noise.clamp_min_(torch.finfo(exp_noise.dtype).tiny)


def _draft_prob_of_drafts(draft_probs: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """[B, k] q_i(x_i): 1 for a deterministic proposer."""
    if draft_probs is None:
        return torch.ones(drafts.shape, device=drafts.device)
    return draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)


def _final_weights(
    batch: RejectionSamplerInput,
    drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
) -> torch.Tensor:
    """[B, V] unnormalised distribution of each row's last token: max(0, p_j - q_j) where draft j
    was rejected (p_j where that has no mass), p_j at the bonus position."""
    target = batch.target_probs
    num_rows, k = drafts.shape
    rows = torch.arange(num_rows, device=target.device)
    p = target[rows, num_accepted].clone()
    if k == 0:
        return p
    rejected = num_accepted < num_drafts
    # Rows that accepted everything may have num_accepted == k; their residual is discarded.
    j = num_accepted.clamp_max(k - 1)
    if batch.draft_probs is None:
        # q is one-hot on x_j, and p(x_j) <= 1: the residual is p without x_j.
        residual = p.scatter(1, drafts[rows, j].unsqueeze(1), 0.0)
    else:
        residual = (p - batch.draft_probs[rows, j]).clamp_min_(0.0)
    has_mass = residual.sum(dim=-1) > 0
    return torch.where((rejected & has_mass).unsqueeze(1), residual, p)


def _emitted(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[B, k + 1]: accepted drafts, the final token at index num_accepted, then placeholders."""
    num_rows, k = drafts.shape
    out = torch.full(
        (num_rows, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=drafts.device
    )
    kept = torch.arange(k, device=drafts.device).unsqueeze(0) < num_accepted.unsqueeze(1)
    out[:, :k] = torch.where(kept, drafts, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out
