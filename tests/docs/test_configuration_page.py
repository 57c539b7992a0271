"""docs/configuration.md against the config dataclasses: one table per model kind (and the OpenAI
frontend) listing every init field of the class that serves it, each with its default.

Defaults are rendered as the page's top states (`render_default`): booleans `true`/`false`, None
`none`, the empty string `""`, anything else `str(value)`; the cell may wrap it in backticks.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from backend_lib.encoder.config import EmbeddingConfig, RerankConfig
from backend_lib.llm.config import LLMConfig
from openai_frontend.config import FrontendConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

KINDS: dict[str, type] = {
    "llm": LLMConfig,
    "embedding": EmbeddingConfig,
    "rerank": RerankConfig,
    "openai frontend": FrontendConfig,
}
"""Heading text (backticks removed, lower case, up to ` (`) -> the dataclass its table lists."""

_HEADING = re.compile(r"^(#{2,6})\s+(.*?)\s*$")


def render_default(value: object) -> str:
    """A default as the page writes it (the spelling a config.pbtxt value takes)."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "none"
    if value == "":
        return '""'
    return str(value)


def field_defaults(cls: type) -> dict[str, str]:
    """Init fields of `cls` -> their rendered defaults (`<required>` for a field without one)."""
    defaults = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = render_default(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = render_default(field.default_factory())
        else:
            defaults[field.name] = "<required>"
    return defaults


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _unquote(cell: str) -> str:
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell


def parse_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """Heading key -> the rows of the first table under it (before the next heading of the same
    or a higher level), each row `{column name: cell}`."""
    tables: dict[str, list[dict[str, str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _HEADING.match(line)
        if not match:
            continue
        level = len(match.group(1))
        key = match.group(2).replace("`", "").split(" (")[0].strip().lower()
        rows: list[dict[str, str]] = []
        header: list[str] | None = None
        for body in lines[i + 1 :]:
            inner = _HEADING.match(body)
            if inner and len(inner.group(1)) <= level:
                break
            if body.lstrip().startswith("|"):
                cells = _cells(body)
                if header is None:
                    header = [cell.lower() for cell in cells]
                elif not all(set(cell) <= set("-: ") for cell in cells):
                    rows.append(dict(zip(header, cells, strict=False)))
            elif header is not None:
                break
        if header is not None:
            tables.setdefault(key, rows)
    return tables


def check_table(rows: list[dict[str, str]], cls: type) -> list[str]:
    """What is wrong with one kind's table against `cls`: missing or unknown parameters, wrong
    defaults, duplicate rows, empty meanings."""
    problems = []
    expected = field_defaults(cls)
    listed: dict[str, str] = {}
    for row in rows:
        name = _unquote(row.get("parameter", ""))
        if name in listed:
            problems.append(f"{name}: listed twice")
        listed[name] = _unquote(row.get("default", ""))
        if not row.get("meaning", "").strip():
            problems.append(f"{name}: no meaning")
    for name in expected.keys() - listed.keys():
        problems.append(f"{name}: a field of {cls.__name__} missing from the page")
    for name in listed.keys() - expected.keys():
        problems.append(f"{name}: on the page but not a field of {cls.__name__}")
    for name in expected.keys() & listed.keys():
        if listed[name] != expected[name]:
            problems.append(
                f"{name}: page says {listed[name]!r}, the field's default is {expected[name]!r}"
            )
    return sorted(problems)


@pytest.fixture(scope="module")
def tables() -> dict[str, list[dict[str, str]]]:
    return parse_tables(PAGE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_page_lists_every_field_with_its_default(tables, kind):
    assert kind in tables, f"no table under a heading naming {kind!r} in {PAGE}"
    assert check_table(tables[kind], KINDS[kind]) == []


def test_tables_have_the_columns():
    for kind, rows in parse_tables(PAGE.read_text(encoding="utf-8")).items():
        if kind in KINDS:
            assert rows and {"parameter", "default", "meaning"} <= rows[0].keys(), kind


def test_a_new_field_without_the_page_fails(tables):
    """The check catches a field added to a class, a field removed and a changed default."""
    added = dataclasses.make_dataclass("Grown", [("new_knob", int, 3)], bases=(LLMConfig,))
    assert check_table(tables["llm"], added) == ["new_knob: a field of Grown missing from the page"]
    rows = [row for row in tables["rerank"] if _unquote(row["parameter"]) != "mode"]
    assert check_table(rows, RerankConfig) == [
        "mode: a field of RerankConfig missing from the page"
    ]
    default = LLMConfig().max_num_seqs
    changed = dataclasses.make_dataclass(
        "Changed", [("max_num_seqs", int, default + 1)], bases=(LLMConfig,)
    )
    assert check_table(tables["llm"], changed) == [
        f"max_num_seqs: page says '{default}', the field's default is '{default + 1}'"
    ]


def test_render_default_rule():
    assert [render_default(v) for v in (True, False, None, "", "auto", 0, 1.0, 1 << 20)] == [
        "true",
        "false",
        "none",
        '""',
        "auto",
        "0",
        "1.0",
        "1048576",
    ]
