"""Batched token sampling with per-row parameters.

Pipeline (vLLM order): min_tokens (ban EOS/stop ids) -> repetition, frequency, presence
penalties -> greedy argmax for temperature 0 (< SAMPLING_EPS), else temperature -> top-k -> top-p -> min-p ->
random draw. Random draws use the exponential race `argmax(p / E)`, E ~ Exp(1) i.i.d., which
picks token i with probability p_i; a seeded row draws its E from its own generator, so its
samples depend only on its seed and history, not on what else is in the batch.

Logprobs are taken from the RAW logits (before penalties, temperature and truncation), as
vLLM's default `raw_logprobs` mode: they describe the model, not the sampling transform.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from backend_lib.llm.core.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample: the request's SamplingParams and its token history."""

    params: SamplingParams
    token_ids: Sequence[int]
    """Prompt followed by the tokens generated so far."""
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    """Per-request generator for seeded rows (on the logits' device); None uses the sampler's."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled token (from the raw logits)."""

    token_id: int
    logprob: float
    rank: int
    """1 + number of tokens strictly more likely than the sampled one."""
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """Per row; None where the row's params.logprobs is None."""


RawLogprobs = tuple[list[int], torch.Tensor] | None
"""The rows asking for logprobs and their log_softmax of the raw logits ([len(rows), V] float32);
None when no row asks."""


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    k = params.top_k
    return vocab_size if k <= 0 else min(k, vocab_size)


def ban_stops_before_min_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int]
) -> None:
    """In place: -inf for stop_token_ids (and EOS unless ignore_eos) in rows below min_tokens."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if r.num_output_tokens >= (r.params.min_tokens or 0):
            continue
        banned = list(r.params.stop_token_ids or [])
        if not r.params.ignore_eos:
            banned += eos_token_ids
        row_idx += [i] * len(banned)
        tok_idx += banned
    if row_idx:
        logits[_ids(row_idx, logits), _ids(tok_idx, logits)] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: repetition penalty (HF: over prompt and output tokens, positive logits divided,
    negative multiplied), then frequency and presence penalties (OpenAI/vLLM: output tokens only,
    logit -= frequency * count + presence * [count > 0])."""
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    use_rep = any(p != 1.0 for p in rep)
    if not use_rep and not any(freq) and not any(pres):
        return
    counts = _token_counts(logits, rows, output_only=True)
    if use_rep:
        seen = (counts > 0) | (_token_counts(logits, rows, output_only=False) > 0)
        penalty = torch.tensor(rep, device=logits.device).unsqueeze(1).expand_as(logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if any(freq) or any(pres):
        freq_t = torch.tensor(freq, device=logits.device).unsqueeze(1)
        pres_t = torch.tensor(pres, device=logits.device).unsqueeze(1)
        logits.sub_(freq_t * counts + pres_t * (counts > 0))


def _token_counts(logits: torch.Tensor, rows: list[SamplingRow], output_only: bool) -> torch.Tensor:
    """[R, V] float occurrence counts of each row's output tokens (or of its prompt tokens)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        toks = (
            r.token_ids[r.num_prompt_tokens :]
            if output_only
            else r.token_ids[: r.num_prompt_tokens]
        )
        row_idx += [i] * len(toks)
        tok_idx += toks
    counts = torch.zeros_like(logits)
    if row_idx:
        ones = torch.ones(len(row_idx), device=logits.device)
        counts.index_put_((_ids(row_idx, logits), _ids(tok_idx, logits)), ones, accumulate=True)
    return counts


def truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf outside each row's top-k, then its top-p nucleus, then its min-p floor."""
    vocab = logits.shape[1]
    top_k = [_top_k(r.params, vocab) for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    dev = logits.device
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        sorted_logits.masked_fill_(
            rank >= torch.tensor(top_k, device=dev).unsqueeze(1), float("-inf")
        )
        top_p_t = torch.tensor(top_p, device=dev).unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        # Rows with top_p == 1 are exempt: rounding could otherwise cut their far tail.
        outside = (mass_before >= top_p_t) & (top_p_t < 1.0)
        sorted_logits.masked_fill_(outside, float("-inf"))
        logits.scatter_(1, order, sorted_logits)
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        floor = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < floor, float("-inf"))


def _tempered_probs(logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]):
    """In place on `logits`: each row's temperature (1 for greedy rows), top-k, top-p and min-p;
    returns their softmax."""
    temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows, strict=True)]
    logits.div_(torch.tensor(temps, device=logits.device).unsqueeze(1))
    truncate(logits, rows)
    return logits.softmax(dim=-1)


def _ids(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


class Sampler:
    """Samples one token per logits row. `eos_token_ids` are banned before min_tokens."""

    def __init__(self, eos_token_ids: Iterable[int], device: torch.device, seed: int = 0):
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [R, V] (any float dtype), one SamplingRow per row."""
        logits, raw_logprobs = self._processed(logits, rows)
        token_ids = self._sample(logits, rows)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, self.gather_logprobs(raw_logprobs, token_ids, rows))

    def target_distribution(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, RawLogprobs]:
        """What each row would be sampled from, for speculative decoding's verification: float32
        [R, V] probabilities after the whole pipeline (min_tokens, penalties, temperature,
        top-k, top-p, min-p); a greedy row gets its processed logits instead (only their argmax
        counts, the very token `__call__` picks). With the raw logprobs of rows asking for them
        (for `gather_logprobs`)."""
        logits, raw_logprobs = self._processed(logits, rows)
        greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
        if all(greedy):
            return logits, raw_logprobs
        greedy_logits = logits.clone() if any(greedy) else None
        probs = _tempered_probs(logits, rows, greedy)
        if greedy_logits is not None:
            is_greedy = torch.tensor(greedy, device=logits.device).unsqueeze(1)
            probs = torch.where(is_greedy, greedy_logits, probs)
        return probs, raw_logprobs

    def _processed(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, RawLogprobs]:
        """A float32 copy of `logits` with min_tokens bans and penalties applied, and the raw
        logprobs taken before them."""
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = self._raw_logprobs(logits, rows)
        ban_stops_before_min_tokens(logits, rows, self.eos_token_ids)
        apply_penalties(logits, rows)
        return logits, raw_logprobs

    # --- sampling ----------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.temperature < SAMPLING_EPS for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1)
        greedy_ids = logits.argmax(dim=-1) if any(greedy) else None
        probs = _tempered_probs(logits, rows, greedy)
        random_ids = probs.div_(self._exponential_noise(probs, rows)).argmax(dim=-1)
        if greedy_ids is None:
            return random_ids
        return torch.where(torch.tensor(greedy, device=logits.device), greedy_ids, random_ids)

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # E == 0 would turn p / E into inf (or NaN for p == 0); the clamp changes nothing else.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    # --- logprobs ----------------------------------------------------------------------------

    def _raw_logprobs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> RawLogprobs:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return None
        return wanted, torch.log_softmax(logits[_ids(wanted, logits)], dim=-1)

    def gather_logprobs(
        self, raw: RawLogprobs, token_ids: torch.Tensor, rows: list[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        """Each row's TokenLogprobs of `token_ids[row]` (int64 [R]); None for rows asking none."""
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if raw is None:
            return result
        wanted, logprobs = raw
        sampled = token_ids[_ids(wanted, logprobs)].unsqueeze(1)
        sampled_lp = logprobs.gather(1, sampled)
        ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
        k = max(rows[i].params.logprobs for i in wanted)
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], sampled[:, :0])
        # One device->host transfer per tensor, then plain Python.
        ids_l, lp_l, rank_l = (
            sampled.squeeze(1).tolist(),
            sampled_lp.squeeze(1).tolist(),
            ranks.tolist(),
        )
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            result[i] = TokenLogprobs(
                ids_l[j], lp_l[j], rank_l[j], top_ids_l[j][:n], top_lp_l[j][:n]
            )
        return result
