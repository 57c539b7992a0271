"""A corpus of small JSON schemas for seeded-sampling tests of structured outputs: nested objects,
bounded arrays, enums, anyOf, required and optional properties, and formats xgrammar supports.

Every schema is bounded (strings by maxLength, arrays by maxItems, integers by a range) so that
a sampled document ends within `MAX_TOKENS` with high probability: a test demanding that most
outputs finish with "stop" then cannot pass vacuously.
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 96
"""Generation budget of one sampled document (compact JSON)."""

_NAME = {"type": "string", "maxLength": 6}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict[str, Any]] = [
    # scalars at the top level
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "string", "maxLength": 5},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "null"},
    # flat objects
    {"type": "object", "properties": {"name": _NAME}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"name": _NAME, "age": _SMALL_INT},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": _NAME},
        "required": ["ok"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "count": _SMALL_INT},
        "required": ["color", "count"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "null"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
    },
    {"type": "object", "properties": {}, "additionalProperties": False},
    # optional properties only
    {
        "type": "object",
        "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
        "additionalProperties": False,
    },
    # nested objects
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": _SMALL_INT, "name": _NAME},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {
                    "inner": {
                        "type": "object",
                        "properties": {"v": {"type": "boolean"}},
                        "required": ["v"],
                    }
                },
                "required": ["inner"],
            }
        },
        "required": ["outer"],
    },
    # arrays with bounds
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _NAME, "maxItems": 2}},
        "required": ["tags"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["p", "q"]}},
            "required": ["k"],
        },
        "maxItems": 2,
    },
    {"type": "array", "prefixItems": [{"type": "boolean"}, _SMALL_INT], "items": False},
    # enums and constants in objects
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "mid", "high"]}, "v": {"const": 1}},
        "required": ["level", "v"],
    },
    {"enum": [1, 2, "three", None, True]},
    # anyOf / oneOf-like unions
    {"anyOf": [{"type": "boolean"}, _SMALL_INT]},
    {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
    {
        "type": "object",
        "properties": {"id": {"anyOf": [_SMALL_INT, {"type": "string", "maxLength": 4}]}},
        "required": ["id"],
    },
    {
        "anyOf": [
            {"type": "object", "properties": {"cat": _NAME}, "required": ["cat"]},
            {"type": "object", "properties": {"dog": _NAME}, "required": ["dog"]},
        ]
    },
    # $defs and references
    {
        "$defs": {"point": {"type": "object", "properties": {"x": _SMALL_INT}, "required": ["x"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
    },
    # formats
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {
        "type": "object",
        "properties": {"host": {"type": "string", "format": "ipv4"}},
        "required": ["host"],
    },
    {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}, "n": _SMALL_INT},
        "required": ["day", "n"],
    },
    # string patterns and lengths
    {"type": "string", "pattern": "^[a-z]{2,4}[0-9]$"},
    {"type": "string", "minLength": 2, "maxLength": 3},
    # numbers with ranges
    {"type": "integer", "minimum": 100, "maximum": 120},
    {
        "type": "object",
        "properties": {
            "lo": {"type": "integer", "minimum": -3, "maximum": 3},
            "flag": {"type": "boolean"},
        },
        "required": ["lo", "flag"],
    },
]
