"""The sample of a test's parametrizations that `make test` runs (tests/sampling.py): every value
of every parameter where n allows, the same choice every time, and the rest marked slow."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tests.sampling import choose

pytest_plugins = ["pytester"]


def grid(rows: int, columns: int) -> dict[str, dict[int, str]]:
    return {
        f"t[r{r}-c{c}]": {0: f"r{r}", 1: f"c{c}"}
        for r, c in itertools.product(range(rows), range(columns))
    }


def covered(test_ids: dict[str, dict[int, str]], kept: set[str]) -> set[tuple[int, str]]:
    return {pair for test_id in kept for pair in test_ids[test_id].items()}


def test_a_sample_as_large_as_the_longest_parameter_covers_every_value():
    for rows, columns in ((2, 4), (4, 2), (3, 3), (1, 6), (2, 5)):
        test_ids = grid(rows, columns)
        kept = choose(test_ids, max(rows, columns))
        assert len(kept) == max(rows, columns)
        assert covered(test_ids, kept) == covered(test_ids, set(test_ids))


def test_the_first_listed_is_kept_and_the_rest_differ_between_tests():
    test_ids = grid(1, 12)
    assert "t[r0-c0]" in choose(test_ids, 2)
    assert choose(test_ids, 3) == choose(test_ids, 3)
    renamed = [{f"{name}{k[1:]}": v for k, v in test_ids.items()} for name in "uvwxyz"]
    rest = {frozenset(k[1:] for k in choose(ids, 2)) for ids in renamed}
    assert len(rest) > 1, "tests over the same values should not all keep the same ones"


def test_n_at_least_the_count_keeps_all_and_zero_is_refused():
    assert choose(grid(2, 2), 9) == set(grid(2, 2))
    with pytest.raises(ValueError, match="at least one"):
        choose(grid(2, 2), 0)


def test_the_rest_are_marked_slow_before_m_deselects(pytester):
    """Through pytest itself, with this repository's conftest hook: `-m "not slow"` runs the
    sample, no -m runs everything."""
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems\n")
    pytester.makeini("[pytest]\nmarkers =\n    slow: s\n    sample(n): s\n")
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.sample(3)\n"
        "@pytest.mark.parametrize('a', ['a-0', 'a-1', 'a-2'])\n"
        "@pytest.mark.parametrize('b', range(2))\n"
        "def test_grid(a, b, request):\n"
        "    print('RAN', request.node.callspec.id)\n"
        "def test_plain():\n"
        "    pass\n"
    )
    pytester.syspathinsert(str(Path(__file__).resolve().parents[1]))
    sampled = pytester.runpytest("-m", "not slow", "-s")
    sampled.assert_outcomes(passed=4, deselected=3)
    ran = set(re.findall(r"RAN (\S+)", sampled.stdout.str()))
    # Every value of both parameters ("-" inside a value's id included), the first listed first.
    assert "0-a-0" in ran
    assert {r.split("-", 1)[1] for r in ran} == {"a-0", "a-1", "a-2"}
    assert {r.split("-", 1)[0] for r in ran} == {"0", "1"}
    pytester.runpytest().assert_outcomes(passed=7)
