"""A class a newcomer can hold in their head: none in backend_lib/ is over MAX_CLASS_LINES lines
(docstrings and comments included), so a growing one is split by concept, not in review."""

from __future__ import annotations

import ast

import pytest

from tooling.repository import REPO_ROOT

MAX_CLASS_LINES = 350


def class_lengths(source: str) -> dict[str, int]:
    """Class name -> its length in lines, for every class (nested ones too) in `source`."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
    }


def test_no_class_is_over_the_limit():
    too_long = {
        f"{path.relative_to(REPO_ROOT)}:{name}": lines
        for path in sorted((REPO_ROOT / "backend_lib").rglob("*.py"))
        for name, lines in class_lengths(path.read_text(encoding="utf-8")).items()
        if lines > MAX_CLASS_LINES
    }
    assert too_long == {}


@pytest.mark.parametrize(
    ("body_lines", "expected"), [(3, 5), (MAX_CLASS_LINES, MAX_CLASS_LINES + 2)]
)
def test_the_count_sees_a_class_body(body_lines, expected):
    """Self-test: a class of `body_lines` statements, plus its header and docstring."""
    source = 'class Big:\n    """Doc."""\n' + "    x = 1\n" * body_lines
    assert class_lengths(source) == {"Big": expected}
    assert (expected > MAX_CLASS_LINES) == (body_lines == MAX_CLASS_LINES)
