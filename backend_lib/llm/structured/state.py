"""One sequence's position in its grammar: an xgrammar matcher advanced by every accepted token,
and, for speculative decoding, looked ahead along draft tokens and rolled back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported on use: a worker rank never builds one (docs/architecture.md)
    import xgrammar as xgr


class GrammarState:
    """Matcher of one sequence. Its state depends only on the tokens accepted, so it survives
    preemption (recompute or swap), prefix-cache hits and chunked prefill unchanged; a child of
    an n > 1 request starts from `fork()` of its parent taken before the parent's first token."""

    def __init__(self, grammar: xgr.CompiledGrammar, matcher: xgr.GrammarMatcher | None = None):
        import xgrammar as xgr

        self.grammar = grammar
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(grammar)
        self.num_accepted = 0
        """Output tokens accepted so far."""

    def fork(self) -> GrammarState:
        """An independent copy at the same position."""
        child = GrammarState(self.grammar, self.matcher.fork())
        child.num_accepted = self.num_accepted
        return child

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it here."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` ([B, ceil(V/32)] int32 on the host,
        bit t % 32 of word t // 32 set for an allowed token t); False if no token is allowed."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows, stopping before one that would complete it
        (the target then emits that token itself, and no row past the end needs a mask). The
        matcher is left where it was."""
        valid = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            valid += 1
            if self.matcher.is_terminated():
                self.matcher.rollback(valid)
                return valid - 1
        self.matcher.rollback(valid)
        return valid

    def fill_drafted(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> int | None:
        """Rows first_row .. first_row + d: the allowed tokens after each prefix of the drafts,
        the matcher rolled back afterwards. Returns the first position with no allowed token
        (None: every reachable row allows some): that row and the ones after allow every token,
        so verification stays finite; the caller decides whether the sequence got that far. Rows
        past a draft the grammar refuses are unreachable (its own row masks it) and allow all."""
        accepted, dead, end = 0, None, len(drafts) + 1
        for i in range(len(drafts) + 1):
            if not self.fill(bitmask, first_row + i):
                dead = end = i
                break
            if i < len(drafts):
                if not self.matcher.accept_token(drafts[i]):
                    end = i + 1
                    break
                accepted += 1
        self.matcher.rollback(accepted)
        bitmask[first_row + end : first_row + len(drafts) + 1] = -1  # every bit set
        return dead
