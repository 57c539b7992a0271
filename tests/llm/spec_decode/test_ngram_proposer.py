"""NgramProposer against transformers' PromptLookupCandidateGenerator, plus edge cases.

transformers matches n-grams from max_matching_ngram_size down to 1 and takes the earliest
occurrence with a continuation, as NgramProposer does; it has no minimum n-gram size, so with
prompt_lookup_min = 1 both must propose the same tokens. With prompt_lookup_min > 1 ours must
be transformers' proposal when its matched n-gram is at least that long, else nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from backend_lib.llm.spec_decode.ngram_proposer import NgramProposer, longest_match

NO_LENGTH_CAP = 1 << 30


def transformers_drafts(tokens: np.ndarray, k: int, max_n: int) -> list[int]:
    """The candidate tokens transformers' prompt lookup appends to `tokens`."""
    generator = PromptLookupCandidateGenerator(
        num_output_tokens=k, max_matching_ngram_size=max_n, max_length=NO_LENGTH_CAP
    )
    input_ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    candidates, _ = generator.get_candidates(input_ids)
    return candidates[0, len(tokens) :].tolist()


def planted_sequence(rng: np.random.Generator) -> np.ndarray:
    """Random tokens from a small vocabulary with copies of earlier spans planted later (and often
    at the end), so matches of every length up to several tokens occur."""
    length = int(rng.integers(2, 120))
    tokens = rng.integers(0, int(rng.integers(2, 30)), size=length)
    for _ in range(int(rng.integers(0, 4))):
        span = int(rng.integers(1, 9))
        if length <= span:
            break
        start = int(rng.integers(0, length - span))
        at_end = rng.random() < 0.6
        dest = length - span if at_end else int(rng.integers(0, length - span + 1))
        tokens[dest : dest + span] = tokens[start : start + span].copy()
    return tokens


def matched_ngram_size(tokens: np.ndarray, max_n: int) -> int:
    """Longest n <= max_n whose suffix n-gram occurs earlier (0 if none), by brute force."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = tokens[length - n :].tolist()
        if any(tokens[s : s + n].tolist() == suffix for s in range(length - n)):
            return n
    return 0


@pytest.mark.parametrize("seed", range(8))
def test_matches_transformers_prompt_lookup(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        tokens = planted_sequence(rng)
        k = int(rng.integers(1, 9))
        max_n = int(rng.integers(1, 7))
        proposer = NgramProposer(k, prompt_lookup_min=1, prompt_lookup_max=max_n)
        assert proposer.propose(tokens) == transformers_drafts(tokens, k, max_n), tokens.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_min_ngram_size_filters_transformers_matches(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(100):
        tokens = planted_sequence(rng)
        k = int(rng.integers(1, 9))
        max_n = int(rng.integers(2, 7))
        min_n = int(rng.integers(2, max_n + 1))
        expected = transformers_drafts(tokens, k, max_n)
        if matched_ngram_size(tokens, max_n) < min_n:
            expected = []
        proposer = NgramProposer(k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
        assert proposer.propose(tokens) == expected, tokens.tolist()


def test_long_context_matches_transformers():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 50_000, size=4096)
    tokens[-6:] = tokens[1000:1006]
    tokens[3000:3006] = tokens[1000:1006]
    proposer = NgramProposer(5, prompt_lookup_min=2, prompt_lookup_max=4)
    drafts = proposer.propose(tokens)
    # the suffix 4-gram is tokens[1002:1006]; its earliest occurrence ends at 1005, not 3005.
    assert drafts == tokens[1006:1011].tolist()
    assert drafts == transformers_drafts(tokens, 5, 4)


def test_longest_ngram_wins_over_earlier_shorter_match():
    tokens = [7, 9, 1, 5, 2, 3, 6, 2, 3, 9, 2, 3]
    # the 3-gram (9, 2, 3) has no earlier occurrence; the 2-gram (2, 3) first ends at 5.
    assert NgramProposer(3, 1, 3).propose(tokens) == [6, 2, 3]
    tokens = [2, 3, 4, 9, 2, 3, 8, 9, 2, 3]
    # the 3-gram (9, 2, 3) ends at 5, beating the 2-gram (2, 3)'s earlier occurrence at 1.
    assert NgramProposer(2, 1, 3).propose(tokens) == [8, 9]
    assert NgramProposer(2, 1, 2).propose(tokens) == [4, 9]


def test_earliest_occurrence_is_taken():
    tokens = [4, 5, 1, 4, 5, 2, 4, 5]
    assert NgramProposer(1, 2, 2).propose(tokens) == [1]
    assert longest_match(np.array(tokens), 2, 2) == 1


def test_no_match_proposes_nothing():
    assert NgramProposer(4, 1, 3).propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(4, 2, 3).propose([1, 2, 3, 1, 5, 3]) == []  # only a 1-gram repeats


def test_sequence_shorter_than_min_proposes_nothing():
    proposer = NgramProposer(4, prompt_lookup_min=3, prompt_lookup_max=5)
    assert proposer.propose([]) == []
    assert proposer.propose([1]) == []
    assert proposer.propose([1, 1, 1]) == []  # the 3-gram has no earlier occurrence
    assert proposer.propose([1, 1, 1, 1]) == [1]


def test_overlapping_occurrence():
    assert NgramProposer(4, 1, 5).propose([3, 3, 3, 3]) == [3]
    assert NgramProposer(4, 1, 5).propose([1, 2, 1, 2, 1, 2]) == [1, 2]


def test_truncated_at_sequence_end():
    tokens = [8, 1, 2, 3, 1, 2]
    assert NgramProposer(10, 1, 2).propose(tokens) == [3, 1, 2]


def test_truncated_at_budget():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    proposer = NgramProposer(3, 1, 2)
    assert proposer.propose(tokens) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_tokens=10) == [3, 4, 5]
    assert proposer.propose(tokens, max_tokens=0) == []
    assert proposer.propose(tokens, max_tokens=-1) == []


def test_accepts_numpy_of_any_integer_dtype():
    tokens = [1, 2, 3, 4, 1, 2]
    proposer = NgramProposer(2, 1, 2)
    for dtype in (np.int32, np.int64, np.uint32):
        assert proposer.propose(np.array(tokens, dtype=dtype)) == [3, 4]
    drafts = proposer.propose(np.array(tokens, dtype=np.int32))
    assert all(type(t) is int for t in drafts)


def test_propose_batch_caps_each_row():
    rows = [[1, 2, 3, 4, 5, 1, 2], [9, 8, 7], [5, 6, 7, 8, 5, 6], np.array([1, 1, 1])]
    proposer = NgramProposer(3, 1, 2)
    assert proposer.propose_batch(rows) == [[3, 4, 5], [], [7, 8, 5], [1]]
    assert proposer.propose_batch(rows, [1, 3, 0, None]) == [[3], [], [], [1]]
    assert proposer.propose_batch([], []) == []
    with pytest.raises(ValueError, match="max_tokens"):
        proposer.propose_batch(rows, [1, 2])


@pytest.mark.parametrize("args", [(0, 1, 2), (2, 0, 2), (2, 3, 2)], ids=["k=0", "min=0", "min>max"])
def test_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        NgramProposer(*args)


def test_rejects_non_sequences():
    proposer = NgramProposer(2, 1, 2)
    with pytest.raises(ValueError, match="shape"):
        proposer.propose(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        proposer.propose([1.0, 2.0, 1.0])
