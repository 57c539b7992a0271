"""NgramProposer: draft tokens by prompt lookup, copied from an earlier repeat of the sequence's end.

For a sequence t[0..L) the proposer finds the longest n in [prompt_lookup_min, prompt_lookup_max]
such that the last n tokens t[L-n..L) also occur ending at some earlier position e <= L-2, and
proposes the tokens that followed that occurrence, t[e+1 .. e+1+k), never past the end of the
sequence (so possibly fewer than k). No such n: no drafts.

Among the occurrences of that longest n-gram the earliest is taken (the one with the smallest
start), as transformers' `PromptLookupCandidateGenerator` and vLLM's first n-gram worker do; the
earliest also tends to have the longest continuation before the sequence's end. Occurrences may
overlap the suffix itself (in "a a a a" the 3-gram "a a a" ends earlier at e = 2).

The search is vectorized with numpy: one pass over the sequence finds the positions whose token
equals the last token, then each further n-gram length only filters those candidates, so a call
costs O(L + candidates x prompt_lookup_max).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenIds = Sequence[int] | np.ndarray
"""One sequence's token ids (prompt and output so far), shape [L], any integer dtype."""


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per sequence by prompt lookup."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        """k: the most drafts one sequence gets per step."""
        self.prompt_lookup_min = prompt_lookup_min
        """Shortest n-gram matched, in tokens."""
        self.prompt_lookup_max = prompt_lookup_max
        """Longest n-gram matched, in tokens."""

    def propose(self, token_ids: TokenIds, max_tokens: int | None = None) -> list[int]:
        """Drafts for one sequence: at most min(k, max_tokens) token ids, possibly none.

        `max_tokens` caps this row (e.g. the tokens it may still generate, or the room left
        before max_model_len); None means k.
        """
        budget = self.num_speculative_tokens if max_tokens is None else max_tokens
        budget = min(budget, self.num_speculative_tokens)
        if budget <= 0:
            return []
        tokens = _as_array(token_ids)
        match = longest_match(tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        if match is None:
            return []
        return tokens[match + 1 : match + 1 + budget].tolist()

    def propose_batch(
        self, sequences: Sequence[TokenIds], max_tokens: Sequence[int | None] | None = None
    ) -> list[list[int]]:
        """`propose` for each row; `max_tokens[i]` caps row i's drafts (None: no caps)."""
        if max_tokens is None:
            max_tokens = [None] * len(sequences)
        if len(max_tokens) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(max_tokens)} max_tokens entries")
        return [self.propose(seq, cap) for seq, cap in zip(sequences, max_tokens, strict=True)]


def longest_match(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """End position e <= L-2 of the earliest occurrence of the longest suffix n-gram, n in
    [min_n, max_n]; None when no suffix of at least min_n tokens occurs earlier.

    `tokens`: shape [L], integer dtype.
    """
    length = len(tokens)
    if length < min_n + 1:
        return None
    # ends: positions e <= L-2 (ascending) where t[e-i] == t[L-1-i] for every i < n.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best = ends if min_n <= 1 else None
    for n in range(2, min(max_n, length - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = ends
    if best is None or best.size == 0:
        return None
    return int(best[0])


def _as_array(token_ids: TokenIds) -> np.ndarray:
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one sequence, shape [L]; got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {tokens.dtype}")
    return tokens
