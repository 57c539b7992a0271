"""Token-budget micro-batching: bounds, coverage, order of results (property-based)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_lib.encoder.batching import plan_micro_batches, run_micro_batches

lengths_strategy = st.lists(st.integers(min_value=1, max_value=600), max_size=300)
budget_strategy = st.integers(min_value=1, max_value=5000)
size_strategy = st.integers(min_value=1, max_value=64)


@settings(max_examples=300, deadline=None)
@given(lengths_strategy, budget_strategy, size_strategy)
def test_plan_respects_bounds_and_covers_each_index_once(lengths, budget, size):
    plan = plan_micro_batches(lengths, budget, size)
    assert sorted(i for batch in plan for i in batch) == list(range(len(lengths)))
    for batch in plan:
        assert 1 <= len(batch) <= size
        padded = len(batch) * max(lengths[i] for i in batch)
        # Only an item over the budget on its own may exceed it.
        assert padded <= budget or (len(batch) == 1 and lengths[batch[0]] > budget)
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)


@settings(max_examples=200, deadline=None)
@given(lengths_strategy, budget_strategy, size_strategy)
def test_plan_is_greedy_no_batch_could_take_the_next_item(lengths, budget, size):
    plan = plan_micro_batches(lengths, budget, size)
    for batch, following in zip(plan, plan[1:], strict=False):
        grown = len(batch) + 1
        assert grown > size or grown * lengths[batch[0]] > budget, "a batch closed early"
        assert lengths[following[0]] <= lengths[batch[-1]]


@settings(max_examples=100, deadline=None)
@given(lengths_strategy, budget_strategy, size_strategy)
def test_results_return_to_input_positions(lengths, budget, size):
    out = np.full((len(lengths), 2), -1.0)
    # Each row's result identifies its item: (index, length).
    batches = run_micro_batches(
        lengths,
        budget,
        size,
        lambda idx: np.array([[i, lengths[i]] for i in idx], dtype=float),
        out,
    )
    np.testing.assert_array_equal(out[:, 0], np.arange(len(lengths)))
    np.testing.assert_array_equal(out[:, 1], lengths)
    assert sum(b.real_tokens for b in batches) == sum(lengths)
    for b in batches:
        assert (
            b.padded_tokens == len(b.indices) * max(lengths[i] for i in b.indices) >= b.real_tokens
        )


def test_invalid_bounds():
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], 0, 4)
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], 4, 0)
