"""Per-request output constraints (`SamplingParams.structured_outputs`), with vLLM's names.

Exactly one kind per request: `json` (a JSON schema, object or JSON text), `json_object` (any JSON
object), `regex`, `choice` (one of these strings) or `grammar` (EBNF/GBNF with a `root` rule).
`disable_any_whitespace` sets the free whitespace JSON may hold between its tokens: `true` none
(compact JSON), `false` any amount (vLLM's default), unset at most
`compile_worker.BOUNDED_WHITESPACE` characters in a row (this engine's default: with unbounded
whitespace an unsure model, sampling, tends to emit whitespace until `max_tokens`).
This module only checks the shape of the request; compiling (and so the deeper syntax checks of
schemas, regexes and grammars) is `backend_lib.llm.structured.compiler`'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend_lib.errors import InputError

MAX_CONSTRAINT_CHARS = 65_536
"""Longest constraint accepted (the schema's JSON text, the regex, the grammar or all choices
together), in characters: compiling grows with it, and it runs on the submitting thread."""
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
_FIELD = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's constraint; build it with `from_value` (validates and normalises)."""

    kind: str
    """One of KINDS."""
    text: str
    """The constraint as compiled: the schema's JSON text (key order kept), the regex, the EBNF
    grammar (a choice list becomes one), or "" for json_object. The grammar cache key."""
    disable_any_whitespace: bool | None = None
    """JSON kinds only (None for the others): True no free whitespace (compact JSON), False any
    (vLLM's default), None (unset) bounded runs of it."""

    @property
    def cache_key(self) -> tuple[str, str, bool | None]:
        return self.kind, self.text, self.disable_any_whitespace

    @classmethod
    def from_value(cls, raw: Any) -> StructuredOutputsParams:
        """From a JSON object (dict) or its JSON text, as clients send `structured_outputs`.
        InputError names the bad field (`structured_outputs.<key>`)."""
        if isinstance(raw, StructuredOutputsParams):
            return raw
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InputError(f"{_FIELD} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InputError(f"{_FIELD} must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(KINDS) - set(_OPTIONS))
        if unknown:
            raise InputError(
                f"unknown {_FIELD} key {unknown[0]!r}; known keys: {', '.join(KINDS + _OPTIONS)}"
            )
        given = [k for k in KINDS if raw.get(k) not in (None, False)]
        if len(given) != 1:
            raise InputError(
                f"{_FIELD} must set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        (kind,) = given
        compact = raw.get("disable_any_whitespace")
        if compact is not None and not isinstance(compact, bool):
            raise InputError(f"{_FIELD}.disable_any_whitespace must be a boolean, got {compact!r}")
        if raw.get("whitespace_pattern") is not None:
            raise InputError(
                f"{_FIELD}.whitespace_pattern is not supported by this engine's grammar backend "
                "(xgrammar); use disable_any_whitespace=true for compact JSON"
            )
        if compact and kind not in ("json", "json_object"):
            raise InputError(
                f"{_FIELD}.disable_any_whitespace applies to json and json_object only"
            )
        text = _TEXT[kind](raw[kind])
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InputError(
                f"{_FIELD}.{kind} is {len(text)} characters long; the limit is "
                f"{MAX_CONSTRAINT_CHARS}"
            )
        return cls(kind, text, compact if kind in ("json", "json_object") else None)


def _schema_text(value: Any) -> str:
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InputError(f"{_FIELD}.json is not valid JSON: {exc}") from None
    else:
        schema = value
    if not isinstance(schema, dict):
        raise InputError(f"{_FIELD}.json must be a JSON schema object, got {type(schema).__name__}")
    return value if isinstance(value, str) else json.dumps(schema)


def _json_object_text(value: Any) -> str:
    if value is not True:
        raise InputError(f"{_FIELD}.json_object must be true, got {value!r}")
    return ""


def _pattern_text(kind: str):
    def text(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise InputError(f"{_FIELD}.{kind} must be a non-empty string, got {value!r}")
        return value

    return text


def _choice_text(value: Any) -> str:
    if not isinstance(value, list) or not value:
        raise InputError(f"{_FIELD}.choice must be a non-empty list of strings, got {value!r}")
    if len(value) > MAX_CHOICES:
        raise InputError(f"{_FIELD}.choice has {len(value)} entries; the limit is {MAX_CHOICES}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise InputError(f"{_FIELD}.choice must hold non-empty strings, got {item!r}")
    return choice_grammar(value)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (vLLM's construction, with escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_TEXT = {
    "json": _schema_text,
    "json_object": _json_object_text,
    "regex": _pattern_text("regex"),
    "choice": _choice_text,
    "grammar": _pattern_text("grammar"),
}
