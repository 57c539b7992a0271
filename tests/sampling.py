"""Sampled parametrizations: `make test` runs a fixed sample of an expensive test's
parametrizations, `make test-all` runs every one.

A test function marked `@pytest.mark.sample(n)` keeps n of its parametrizations in `make test`;
tests/conftest.py marks the others `slow`, which `make test` deselects (`-m "not slow"`). The
sample is chosen, not drawn: the first parametrization listed (the test's main case) is kept;
then, while fewer than n are, the one that adds most parameter values not yet kept, ties broken
by a hash of its test id. So every value of every parameter runs where n allows (a 2 x 4 grid sampled 4 keeps each of the 4 rows and both
columns), the same items run on every machine and every xdist worker, and two tests over one
shared fixture parameter need not keep the same value of it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping

import pytest

MARKER = "sample"


def choose(test_ids: Mapping[str, Mapping[int, str]], n: int) -> set[str]:
    """Which n of a test function's parametrizations to keep.

    test_ids: test id -> {parameter: the id of its value}, in collection order.
    """
    if n < 1:
        raise ValueError(f"@pytest.mark.{MARKER}(n) keeps at least one parametrization, not {n}")
    first = next(iter(test_ids))
    order = sorted(test_ids, key=lambda test_id: hashlib.sha256(test_id.encode()).hexdigest())
    kept = [first]
    covered = set(test_ids[first].items())
    while len(kept) < min(n, len(order)):
        best = max(
            (test_id for test_id in order if test_id not in kept),
            key=lambda test_id: len(set(test_ids[test_id].items()) - covered),
        )  # max keeps the first of equals: hash order breaks ties
        kept.append(best)
        covered |= set(test_ids[best].items())
    return set(kept)


def value_ids(item: pytest.Item) -> dict[int, str]:
    """{parameter: its value's id} of a parametrized item: one parameter per `parametrize` (or
    parametrized fixture), the ids pytest joins with "-" into the test id."""
    # callspec.indices cannot serve: stacked parametrize decorators number their product, not
    # each one's values. _idlist is the id parts, one per parameter.
    parts = getattr(item.callspec, "_idlist", None) or [item.callspec.id]
    return dict(enumerate(parts))


def unsampled(items: Iterable[pytest.Item]) -> list[pytest.Item]:
    """The parametrized items left out of their test's sample (those to mark slow)."""
    functions: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if item.get_closest_marker(MARKER) is not None and hasattr(item, "callspec"):
            functions[item.nodeid.split("[", 1)[0]].append(item)
    left_out = []
    for members in functions.values():
        (n,) = members[0].get_closest_marker(MARKER).args
        kept = choose({item.nodeid: value_ids(item) for item in members}, n)
        left_out += [item for item in members if item.nodeid not in kept]
    return left_out
