"""SpeculativeConfig: the `speculative_config` parameter of an LLM's config.pbtxt, parsed and checked.

The parameter's value is a JSON object with vLLM's field names, for example
`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}` or
`{"method": "draft_model", "model": "draft", "num_speculative_tokens": 4, "quantization": "int8"}`.
An empty value means no speculation. Every problem raises `ConfigError` naming the field as
`speculative_config.<field>`, so a bad value fails only that model's load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from backend_lib.config import ConfigError, require
from backend_lib.quantization import QUANTIZATION_SETTINGS

PARAMETER = "speculative_config"
"""The config.pbtxt parameter holding the JSON object."""

METHODS = ("ngram", "draft_model")
"""Ways of proposing draft tokens (vLLM's `method` names)."""

MAX_SPECULATIVE_TOKENS = 16
"""Largest `num_speculative_tokens`. Each speculating sequence needs k + 1 verification rows per
step (k drafts and the bonus token), all in one step's token budget (max_num_batched_tokens), and
k KV slots reserved ahead of its accepted length; with an acceptance rate a < 1 the expected gain
of the k-th draft is a^k, so drafts past 16 cost rows and slots for almost no tokens."""

MAX_PROMPT_LOOKUP = 32
"""Largest `prompt_lookup_max`: an n-gram longer than this almost never repeats verbatim where a
shorter one does not, and the proposer's cost grows with it."""

DEFAULT_PROMPT_LOOKUP = 5
"""`prompt_lookup_min` and `prompt_lookup_max` when neither is given (vLLM's choice)."""

ALIASES = {"disable_by_batch_size": "speculative_disable_by_batch_size"}
"""Other accepted JSON keys: vLLM's newer name of the batch-size threshold."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How draft tokens are proposed and verified. Names follow vLLM's SpeculativeConfig."""

    method: Literal["ngram", "draft_model"]
    """ngram: drafts copied from an earlier repeat of the sequence's last n tokens (prompt
    lookup, no extra model). draft_model: drafts decoded by the smaller checkpoint `model`.
    Omitted in the JSON: draft_model when `model` is given (as vLLM infers it), else an error."""
    num_speculative_tokens: int
    """Draft tokens proposed per sequence per step, k, in 1..MAX_SPECULATIVE_TOKENS (required)."""
    prompt_lookup_max: int | None = None
    """ngram only: longest n-gram matched, in tokens, <= MAX_PROMPT_LOOKUP. As vLLM: when only
    prompt_lookup_min is given it is that value; when neither, DEFAULT_PROMPT_LOOKUP (5). None
    for draft_model."""
    prompt_lookup_min: int | None = None
    """ngram only: shortest n-gram matched, in tokens, >= 1 and <= prompt_lookup_max. As vLLM:
    when only prompt_lookup_max is given it is that value; when neither, DEFAULT_PROMPT_LOOKUP
    (5). None for draft_model."""
    model: str | None = None
    """draft_model only (required there): the draft checkpoint directory, relative to the model
    dir like LLMConfig.model. None for ngram."""
    quantization: str | None = None
    """draft_model only: the draft's weight quantization, as LLMConfig.quantization (vLLM's field):
    auto (or null) loads it as stored, a full-precision draft in full precision; int8 quantizes
    its projections and lm_head at load (per output channel; on CPU fbgemm's W8A8-dynamic GEMM),
    fp8 likewise on CUDA. A draft's weights are read k times a step for tokens the target then
    verifies, so their precision moves the acceptance rate only, never the output. None for
    ngram."""
    speculative_disable_by_batch_size: int | None = None
    """Speculation is off for a step with more running sequences than this (>= 2); None: never
    off. The JSON key may also be vLLM's newer `disable_by_batch_size`."""

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig | None:
        """Parse the parameter's JSON value; "" (or only whitespace) means no speculation: None."""
        if not text.strip():
            return None
        values = _resolve_defaults(_parse_fields(text))
        config = cls(**values)
        config.validate()
        return config

    def enabled_for(self, num_running_seqs: int) -> bool:
        """Whether a step with `num_running_seqs` running sequences speculates."""
        limit = self.speculative_disable_by_batch_size
        return limit is None or num_running_seqs <= limit

    def validate(self) -> None:
        _check_method(self.method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens)
        require(
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            _key("num_speculative_tokens"),
            self.num_speculative_tokens,
            f"must be in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        if self.method == "ngram":
            self._validate_ngram()
        else:
            self._validate_draft_model()
        limit = self.speculative_disable_by_batch_size
        if limit is not None:
            _check_int("speculative_disable_by_batch_size", limit)
            require(
                limit >= 2,
                _key("speculative_disable_by_batch_size"),
                limit,
                "must be >= 2 (or null: never disabled)",
            )

    def _validate_ngram(self) -> None:
        _refuse("model", self.model, "ngram")
        _refuse("quantization", self.quantization, "ngram")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _check_int("prompt_lookup_min", lo)
        _check_int("prompt_lookup_max", hi)
        require(lo >= 1, _key("prompt_lookup_min"), lo, "must be >= 1")
        require(
            hi <= MAX_PROMPT_LOOKUP,
            _key("prompt_lookup_max"),
            hi,
            f"must be <= {MAX_PROMPT_LOOKUP}",
        )
        require(
            hi >= lo,
            _key("prompt_lookup_max"),
            hi,
            f"must be >= prompt_lookup_min ({lo})",
        )

    def _validate_draft_model(self) -> None:
        _refuse("prompt_lookup_min", self.prompt_lookup_min, "draft_model")
        _refuse("prompt_lookup_max", self.prompt_lookup_max, "draft_model")
        require(
            isinstance(self.model, str) and self.model.strip() != "",
            _key("model"),
            self.model,
            "draft_model needs the draft checkpoint directory (a non-empty string)",
        )
        require(
            self.quantization is None or self.quantization in QUANTIZATION_SETTINGS,
            _key("quantization"),
            self.quantization,
            f"expected one of {', '.join(QUANTIZATION_SETTINGS)} (or null)",
        )


def _key(field: str) -> str:
    return f"{PARAMETER}.{field}"


def _parse_fields(text: str) -> dict[str, Any]:
    """The JSON object's fields under their dataclass names; unknown keys are errors."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(PARAMETER, text, f"invalid JSON: {error}") from None
    require(isinstance(raw, dict), PARAMETER, text, "expected a JSON object")
    known = sorted(FIELDS | set(ALIASES))
    values: dict[str, Any] = {}
    for key, value in raw.items():
        require(key in known, _key(key), value, f"unknown field; known: {', '.join(known)}")
        name = ALIASES.get(key, key)
        require(name not in values, _key(key), value, f"given twice (also as {name})")
        values[name] = value
    return values


def _resolve_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """Fill `method` and the prompt-lookup bounds as vLLM does; check `num_speculative_tokens`
    is present. An error about a field given under an alias names the field's own name."""
    if "method" not in values:
        require(
            values.get("model") is not None,
            _key("method"),
            None,
            f"required (one of {', '.join(METHODS)}) unless `model` names a draft checkpoint",
        )
        values["method"] = "draft_model"
    _check_method(values["method"])
    require(
        "num_speculative_tokens" in values,
        _key("num_speculative_tokens"),
        None,
        f"required: an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
    )
    if values["method"] == "ngram":
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        for field, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _check_int(field, value)  # before one bound follows the other
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        values["prompt_lookup_min"] = hi if lo is None else lo
        values["prompt_lookup_max"] = lo if hi is None else hi
    return values


def _check_method(method: Any) -> None:
    require(method in METHODS, _key("method"), method, f"expected one of {', '.join(METHODS)}")


def _check_int(field: str, value: Any) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool),
        _key(field),
        value,
        "expected an integer",
    )


def _refuse(field: str, value: Any, method: str) -> None:
    require(value is None, _key(field), value, f"not used by method {method}")


FIELDS = frozenset(SpeculativeConfig.__dataclass_fields__)
"""The JSON keys accepted under their own names (the dataclass fields)."""
