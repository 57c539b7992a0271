"""Per-request sampling settings, with vLLM's field names, defaults and validation rules."""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend_lib.config import ConfigError, parse_bool
from backend_lib.errors import InputError
from backend_lib.llm.structured.params import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample one request's output. Construction validates intrinsic ranges and normalises:
    `stop` becomes a list, `top_k=0` becomes -1 (disabled), and greedy requests (temperature 0)
    get top_p=1, top_k=-1, min_p=0. Deployment limits (max_logprobs, max_n) are checked by
    `validate(max_logprobs=..., max_n=...)`, which `from_dict` calls."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    """None: generate until max_model_len."""
    min_tokens: int = 0
    """Stops (EOS, stop_token_ids, stop strings) are ignored until this many tokens are generated."""
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Number of top log-probabilities returned per generated token (None: none)."""
    prompt_logprobs: int | None = None
    """Number of top log-probabilities returned per prompt token, besides the prompt token's own
    (None: none). Computed during prefill from the raw logits; such a request skips the prefix
    cache, as in vLLM, so that every position is computed."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    """Output constraint (JSON schema, regex, choice, grammar); a dict or its JSON text is
    converted on construction (see backend_lib/llm/structured/params.py)."""

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.validate()
        if self.top_k == 0:
            self.top_k = -1
        if self.is_greedy:
            # Greedy ignores the truncation knobs; normalise so the sampler can batch it simply.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streaming detokenizer must hold back so a partial stop string never leaks."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def validate(self, *, max_logprobs: int | None = None, max_n: int | None = None) -> None:
        """Raise InputError naming the first field out of range (limits of None are not checked)."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{name} must be a number, got {value!r}",
            )
            _check(math.isfinite(value), f"{name} must be finite, got {value}")
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))

        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        if max_n is not None:
            _check(self.n <= max_n, f"n must be <= {max_n}, got {self.n}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check(
                _SEED_MIN <= self.seed <= _SEED_MAX,
                f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}",
            )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check(value >= 0, f"{name} must be >= 0, got {value}")
            if max_logprobs is not None:
                _check(value <= max_logprobs, f"{name} must be <= {max_logprobs}, got {value}")
        for text in self.stop:  # type: ignore[union-attr]
            _check(
                isinstance(text, str) and text != "",
                f"stop must contain non-empty strings, got {text!r}",
            )
        for token in self.stop_token_ids:  # type: ignore[union-attr]
            _check(
                isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                f"stop_token_ids must contain token ids >= 0, got {token!r}",
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(
                isinstance(getattr(self, name), bool),
                f"{name} must be a boolean, got {getattr(self, name)!r}",
            )
        if self.is_greedy:
            _check(
                self.n == 1, f"n must be 1 when using greedy sampling (temperature=0), got {self.n}"
            )

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], *, max_logprobs: int | None = None, max_n: int | None = None
    ) -> SamplingParams:
        """Build from a JSON object as clients of Triton's vLLM backend send it.

        Numbers and booleans may arrive as strings ("100", "0.7", "false"); `stop` may be a string
        or a list. Unknown fields and values of the wrong type raise InputError. The limits are
        the deployment's (`LLMConfig.max_logprobs`, `LLMConfig.max_n`); None leaves one unchecked.
        """
        if not isinstance(d, dict):
            raise InputError(f"sampling parameters must be a JSON object, got {type(d).__name__}")
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in d.items():
            if key not in known:
                raise InputError(
                    f"unknown sampling parameter '{key}'; known parameters: "
                    f"{', '.join(sorted(known))}"
                )
            values[key] = _parse_field(key, raw, hints[key])
        params = cls(**values)
        params.validate(max_logprobs=max_logprobs, max_n=max_n)
        return params


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def _check_int(name: str, value: Any) -> None:
    _check(
        isinstance(value, int) and not isinstance(value, bool),
        f"{name} must be an integer, got {value!r}",
    )


def _parse_field(key: str, raw: Any, annotation: Any) -> Any:
    """Convert one JSON value to the field's annotated type."""
    args = typing.get_args(annotation)
    if raw is None and type(None) in args:
        return None
    if key == "stop":
        if isinstance(raw, str):
            return [raw]
        return _parse_list(key, raw, _parse_str)
    if key == "stop_token_ids":
        return _parse_list(key, raw, parse_int)
    if key == "structured_outputs":
        return StructuredOutputsParams.from_value(raw)
    base = next((a for a in args if a is not type(None)), annotation)
    parser = {bool: _parse_bool, int: parse_int, float: parse_float}[base]
    return parser(key, raw)


def _parse_list(key: str, raw: Any, parse_item: Callable[[str, Any], Any]) -> list:
    if not isinstance(raw, list):
        raise InputError(f"{key} must be a list, got {raw!r}")
    return [parse_item(key, item) for item in raw]


def _parse_str(key: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise InputError(f"{key} must contain strings, got {raw!r}")
    return raw


def _parse_bool(key: str, raw: Any) -> bool:
    if not isinstance(raw, (bool, int, str)):
        raise InputError(f"{key} must be a boolean, got {raw!r}")
    try:
        return parse_bool(key, raw)
    except ConfigError:
        raise InputError(f"{key} must be a boolean (true/false), got {raw!r}") from None


def parse_int(key: str, raw: Any) -> int:
    """An integer field of a vLLM-backend client's JSON (100, 100.0 or "100"); InputError naming
    `key` otherwise."""
    if isinstance(raw, bool):
        raise InputError(f"{key} must be an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)  # JSON encoders may write 100 as 100.0
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise InputError(f"{key} must be an integer, got {raw!r}")


def parse_float(key: str, raw: Any) -> float:
    """A number field of a vLLM-backend client's JSON (0.7 or "0.7"); InputError naming `key`
    otherwise."""
    if isinstance(raw, bool):
        raise InputError(f"{key} must be a number, got {raw!r}")
    if isinstance(raw, int) and abs(raw) > 2**1023:
        raise InputError(f"{key} must be a number within float range, got {raw}")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            pass
    raise InputError(f"{key} must be a number, got {raw!r}")
