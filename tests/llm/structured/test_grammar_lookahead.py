"""A grammar's look-ahead along draft tokens (speculative decoding under a constraint), against
fresh xgrammar matchers: `num_valid_drafts` keeps the drafts the grammar allows, short of one that
completes it; `fill_drafted` writes, for each prefix of the drafts, the mask a matcher that
accepted that prefix gives; both leave the matcher where it was."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from backend_lib.llm.structured.state import GrammarState
from tests.llm.shakespeare_helpers import SHAKESPEARE

REGEX = r"(ay|no), my lord[.!]"


@pytest.fixture(scope="module")
def setup():
    tokenizer = AutoTokenizer.from_pretrained(SHAKESPEARE, local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    grammar = xgr.GrammarCompiler(info, cache_enabled=False).compile_regex(REGEX)
    return tokenizer, grammar, info.vocab_size


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _mask_after(grammar, vocab_size: int, tokens: list[int]) -> torch.Tensor:
    matcher = xgr.GrammarMatcher(grammar)
    for token in tokens:
        assert matcher.accept_token(token)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return mask[0]


def test_valid_drafts_stop_at_a_refused_token_and_before_the_end(setup):
    tokenizer, grammar, vocab = setup
    state = GrammarState(grammar)
    good = _ids(tokenizer, "ay, my lord")
    bad = _ids(tokenizer, " sir")
    assert state.num_valid_drafts(good + bad) == len(good)
    assert state.num_valid_drafts(bad) == 0
    # The token that completes the grammar is left to the target (no mask past the end).
    full = _ids(tokenizer, "ay, my lord.") + [tokenizer.eos_token_id]
    assert state.num_valid_drafts(full) < len(full)
    mask = xgr.allocate_token_bitmask(1, vocab)
    assert state.fill(mask, 0)
    assert torch.equal(mask[0], _mask_after(grammar, vocab, []))  # still at the start
    assert state.num_accepted == 0
    assert state.accept(good[0])  # the matcher was rolled back: it is at the start


def test_drafted_rows_hold_each_prefixs_mask_and_unreachable_rows_allow_all(setup):
    tokenizer, grammar, vocab = setup
    state = GrammarState(grammar)
    drafts = _ids(tokenizer, "no, my")
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 2, vocab)
    assert state.fill_drafted(bitmask, 1, drafts) is None
    for i in range(len(drafts) + 1):
        assert torch.equal(bitmask[1 + i], _mask_after(grammar, vocab, drafts[:i])), i
    # A refused draft: its own row masks it, the rows after it are unreachable and allow all.
    refused = drafts[:1] + _ids(tokenizer, " sir")[:1]
    bitmask = xgr.allocate_token_bitmask(len(refused) + 1, vocab)
    assert state.fill_drafted(bitmask, 0, refused) is None
    assert torch.equal(bitmask[1], _mask_after(grammar, vocab, refused[:1]))
    assert (bitmask[2] == -1).all()
    assert state.accept(drafts[0])  # rolled back both times
