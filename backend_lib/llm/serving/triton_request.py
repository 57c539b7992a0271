"""Triton `llm` request tensors -> a generate request, with the vLLM backend's tensor names and
semantics (plus TensorRT-LLM-style scalar inputs, so `/generate` JSON like {"max_tokens": 20} works).

Structured outputs come as `structured_outputs` inside `sampling_parameters` (vLLM's name, a JSON
object or its text) or as TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide`
inputs (GUIDE_TYPES maps them to the same thing); sending both is an error.

`lora_name` inside `sampling_parameters` picks a LoRA adapter, as in the vLLM backend (the
engine checks it; see backend_lib/llm/lora/registry.py), and `priority` (an integer, lower first,
vLLM's request field) its place under `scheduling_policy: priority` (the engine checks it too).
`deadline_ms` there, and Triton's own request timeout (microseconds, as tritonclient sends it),
bound how long the request may take (the earlier of the two; serving/service.py). `tenant` there
names who it is served for (core/tenants.py; the frontend passes the API key's name or `user`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_lib.contract import (
    EXCLUDE_INPUT_IN_OUTPUT,
    IMAGE,
    PROMPT_TOKEN_IDS,
    RETURN_FLAGS,
    SAMPLING_PARAMETERS,
    STREAM,
    TEXT_INPUT,
)
from backend_lib.errors import InputError
from backend_lib.llm.core.sampling_params import SamplingParams, parse_float, parse_int
from backend_lib.llm.multimodal_config import MultiModalConfig
from backend_lib.multimodal.image_sources import image_input_bytes
from backend_lib.multimodal.images import DecodedImage, decode_image
from backend_lib.triton_io import Inputs, read_scalar, read_strings

# RETURN_FLAGS, the llm's `return_*` inputs, are backend_lib.contract's (shared with the frontend).

# Scalar inputs (TensorRT-LLM style) and the type each one's value must have. When a field comes both
# as a scalar input and inside `sampling_parameters`, the scalar input wins: it is the more specific.
SCALAR_INPUTS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "min_tokens": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}

# TensorRT-LLM's guided_decoding_guide_type -> the structured_outputs key its guide fills.
GUIDE_TYPES = {
    "json": "json_object",
    "json_schema": "json",
    "regex": "regex",
    "ebnf_grammar": "grammar",
}


@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    prepend_input: bool
    """Non-streaming responses start with the prompt unless `exclude_input_in_output` is true."""
    return_flags: dict[str, bool]
    lora_name: str | None = None
    """The adapter named in sampling_parameters (None: the base model)."""
    prompt_token_ids: list[int] | None = None
    """The prompt as token ids (the `prompt_token_ids` input; `prompt` is then empty)."""
    priority: int = 0
    """The `priority` in sampling_parameters (lower first; 0 when absent)."""
    deadline_ms: float | None = None
    """The `deadline_ms` in sampling_parameters: the request must finish within this many
    milliseconds of its arrival (None: no deadline of its own)."""
    tenant: str | None = None
    """The `tenant` in sampling_parameters: who it is served for (fair share, per-tenant limits
    and metrics; None: its adapter's, else the default tenant)."""
    images: tuple[DecodedImage, ...] = ()
    """The `image` input's images, decoded within the model's limits: each element one PNG, JPEG
    or WebP file, as base64 text (what Triton's vLLM backend clients send) or raw bytes."""


def parse_generate_request(
    inputs: Inputs,
    *,
    max_prompt_bytes: int,
    max_logprobs: int,
    max_n: int,
    multimodal: MultiModalConfig | None = None,
) -> GenerateRequest:
    """Read one request's tensors; InputError names the offending input or field. `multimodal`:
    the model's image settings (None: it takes no images)."""
    (prompt,) = _single(read_strings(inputs, TEXT_INPUT, max_bytes=max_prompt_bytes), TEXT_INPUT)
    token_ids = _prompt_token_ids(inputs)
    if token_ids is not None and prompt:
        raise InputError(
            f"send the prompt as '{TEXT_INPUT}' or as '{PROMPT_TOKEN_IDS}', not both "
            f"(leave '{TEXT_INPUT}' empty)"
        )
    if token_ids is None and not prompt:
        raise InputError(f"input '{TEXT_INPUT}' is empty: send a non-empty prompt")
    stream = bool(read_scalar(inputs, STREAM, bool))
    exclude = read_scalar(inputs, EXCLUDE_INPUT_IN_OUTPUT, bool)
    # As the vLLM backend: streaming never prepends; asking for it explicitly is an error.
    prepend_input = not exclude if exclude is not None else not stream
    if stream and prepend_input:
        raise InputError(
            "when streaming, exclude_input_in_output=false is not allowed: "
            "streamed responses carry only new text"
        )
    fields = _sampling_fields(inputs)
    lora_name = fields.pop("lora_name", None)
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise InputError(f"lora_name must be a non-empty string, got {lora_name!r}")
    priority = parse_int("priority", fields.pop("priority", 0))
    tenant = fields.pop("tenant", None)
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InputError(f"tenant must be a non-empty string, got {tenant!r}")
    deadline_ms = fields.pop("deadline_ms", None)
    if deadline_ms is not None:
        deadline_ms = parse_float("deadline_ms", deadline_ms)
        if not 0 < deadline_ms < float("inf"):
            raise InputError(f"deadline_ms must be a finite number > 0, got {deadline_ms!r}")
    params = SamplingParams.from_dict(fields, max_logprobs=max_logprobs, max_n=max_n)
    flags = {name: bool(read_scalar(inputs, name, bool)) for name in RETURN_FLAGS}
    return GenerateRequest(
        prompt,
        params,
        stream,
        prepend_input,
        flags,
        lora_name,
        token_ids,
        priority,
        deadline_ms,
        tenant,
        _images(inputs, multimodal),
    )


def _images(inputs: Inputs, settings: MultiModalConfig | None) -> tuple[DecodedImage, ...]:
    """The `image` input's images, counted before any is decoded (refused at once by a model
    that takes none)."""
    if IMAGE not in inputs:
        return ()
    if settings is None:
        raise InputError("this model takes no images (it is not a vision-language model)")
    values = np.asarray(inputs[IMAGE], dtype=object).reshape(-1)
    if len(values) > settings.max_images:
        raise InputError(
            f"the request has {len(values)} images; at most {settings.max_images} are allowed "
            "(limit_mm_per_prompt)"
        )
    limits = settings.limits
    return tuple(
        decode_image(image_input_bytes(value, limits.max_image_bytes), limits) for value in values
    )


def _prompt_token_ids(inputs: Inputs) -> list[int] | None:
    """The `prompt_token_ids` input as a list (the engine checks them against its vocabulary and
    max_model_len)."""
    if PROMPT_TOKEN_IDS not in inputs:
        return None
    ids = np.asarray(inputs[PROMPT_TOKEN_IDS])
    if ids.dtype.kind not in "iu":
        raise InputError(f"input '{PROMPT_TOKEN_IDS}' must hold integers, got {ids.dtype}")
    if ids.size == 0:
        raise InputError(f"input '{PROMPT_TOKEN_IDS}' is empty: send at least one token id")
    return [int(token) for token in ids.reshape(-1)]


def _single(values: list[str], name: str) -> list[str]:
    if len(values) != 1:
        raise InputError(f"input '{name}' must hold exactly one prompt, got {len(values)}")
    return values


def _sampling_fields(inputs: Inputs) -> dict[str, Any]:
    """The sampling_parameters JSON object, overlaid with the scalar inputs present."""
    fields: dict[str, Any] = {}
    if SAMPLING_PARAMETERS in inputs:
        (text,) = _single(read_strings(inputs, SAMPLING_PARAMETERS), SAMPLING_PARAMETERS)
        if text.strip():
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"input 'sampling_parameters' is not valid JSON: {exc}") from None
            if not isinstance(fields, dict):
                raise InputError(
                    "input 'sampling_parameters' must be a JSON object, got "
                    f"{type(fields).__name__}"
                )
    for name, kind in SCALAR_INPUTS.items():
        value = read_scalar(inputs, name, kind)
        if value is not None:
            fields[name] = value
    if "stop_words" in inputs:
        words = np.asarray(inputs["stop_words"]).reshape(-1, 1)
        fields["stop"] = read_strings({"stop_words": words}, "stop_words")
    guided = _guided_decoding(inputs)
    if guided is not None:
        if fields.get("structured_outputs") is not None:
            raise InputError(
                "send structured_outputs in sampling_parameters or the guided_decoding_* inputs, "
                "not both"
            )
        fields["structured_outputs"] = guided
    return fields


def _guided_decoding(inputs: Inputs) -> dict[str, Any] | None:
    """`guided_decoding_guide_type` (+ `guided_decoding_guide`) as a structured_outputs dict."""
    guide_type = read_scalar(inputs, "guided_decoding_guide_type", str)
    guide = read_scalar(inputs, "guided_decoding_guide", str)
    if guide_type is None:
        if guide is not None:
            raise InputError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    if guide_type not in GUIDE_TYPES:
        raise InputError(
            f"input 'guided_decoding_guide_type' must be one of {', '.join(GUIDE_TYPES)}, "
            f"got {guide_type!r}"
        )
    key = GUIDE_TYPES[guide_type]
    if key == "json_object":
        return {"json_object": True}
    if not guide:
        raise InputError(f"input 'guided_decoding_guide' is required for guide type {guide_type!r}")
    return {key: guide}
