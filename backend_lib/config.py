"""Typed model configuration filled from the `parameters` of a Triton `config.pbtxt`.

Every model kind has one dataclass (its single source of truth). Fields are filled from
string parameters by their type annotations, then `validate()` runs once. Any problem
raises `ConfigError` naming the key and the offending value, so a bad value makes only
that model fail to load.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from backend_lib import contract

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""

    def __init__(self, key: str, value: Any, reason: str):
        self.key, self.value, self.reason = key, value, reason
        super().__init__(f"invalid config parameter '{key}'={value!r}: {reason}")


def parse_bool(key: str, raw: Any) -> bool:
    """Parse a boolean as `contract.parse_bool` does (true/false/1/0/yes/no/on/off, any case)."""
    try:
        return contract.parse_bool(raw)
    except ValueError:
        raise ConfigError(key, raw, "expected a boolean (true/false)") from None


def _convert(key: str, raw: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        empty = raw is None or (
            isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")
        )
        if empty and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(key, raw, inner[0])
    if origin is typing.Literal:
        text = str(raw).strip()
        if text not in args:
            raise ConfigError(key, raw, f"expected one of {', '.join(map(str, args))}")
        return text
    if annotation is bool:
        return parse_bool(key, raw)
    if annotation is int:
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ConfigError(key, raw, "expected an integer") from None
    if annotation is float:
        try:
            value = float(str(raw).strip())
        except ValueError:
            raise ConfigError(key, raw, "expected a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(key, raw, "expected a finite number")
        return value
    if annotation is str:
        return str(raw)
    raise TypeError(f"unsupported config field type {annotation!r} for '{key}'")


def from_parameters(cls: type[T], params: Mapping[str, Any]) -> T:
    """Build the config dataclass `cls` from string parameters, then validate it.

    Unknown keys are errors (a typo must not silently fall back to a default).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, raw in params.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(key, raw, f"unknown parameter; known parameters: {known}")
        values[key] = _convert(key, raw, hints[key])
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def triton_parameters(model_config: Mapping[str, Any] | str) -> dict[str, str]:
    """Flatten `parameters { key: "k" value: { string_value: "v" } }` of a Triton model config.

    Accepts the JSON string Triton passes as `args['model_config']` or its parsed dict.
    """
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    raw = model_config.get("parameters") or {}
    return {key: value.get("string_value", "") for key, value in raw.items()}


def version_parameters(model_config: Mapping[str, Any] | str, version: str) -> dict[str, str]:
    """`triton_parameters` of one served version: `{version}` in a value becomes the version number,
    so versions served side by side can use their own files (`model: "{version}/checkpoint"`)."""
    return {
        key: value.replace("{version}", version)
        for key, value in triton_parameters(model_config).items()
    }


def require(condition: bool, key: str, value: Any, reason: str) -> None:
    """Raise `ConfigError(key, value, reason)` unless `condition` holds."""
    if not condition:
        raise ConfigError(key, value, reason)
