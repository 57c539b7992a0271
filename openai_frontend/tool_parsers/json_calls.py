"""Calls written as JSON objects `{"name": ..., "arguments": {...}}`, as the JSON formats share
them (hermes, llama3_json, mistral)."""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.tool_parsers.base import arguments_json

ARGUMENT_KEYS = ("arguments", "parameters")
"""Where a call object holds its arguments: `arguments` (hermes, mistral) or `parameters` (Llama
3's own prompt format); either is accepted, as vLLM's llama3_json parser does."""


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def strict_loads(text: str) -> Any:
    """The JSON value of `text` (NaN and Infinity refused: arguments must be JSON again);
    ValueError when it is not JSON."""
    return json.loads(text, parse_constant=_refuse)


def loads(text: str) -> Any:
    """The JSON value of `text`; None when it is not JSON."""
    try:
        return strict_loads(text)
    except ValueError:
        return None


def call(value: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one call object; None when `value` is not one: an object
    with a string `name` and an object of arguments (one of `ARGUMENT_KEYS`, not both)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    given = [key for key in ARGUMENT_KEYS if key in value]
    if len(given) != 1 or not isinstance(value[given[0]], dict):
        return None
    return value["name"], arguments_json(value[given[0]])


def calls(values: Any) -> list[tuple[str, str]] | None:
    """The calls of a JSON array of call objects; None unless every item is one (and there is
    at least one)."""
    if not isinstance(values, list) or not values:
        return None
    found = [call(value) for value in values]
    return None if any(item is None for item in found) else found  # type: ignore[return-value]
