"""Triton `llm` request tensors -> a generate request, with the vLLM backend's tensor names and
semantics (plus TensorRT-LLM-style scalar inputs, so `/generate` JSON like {"max_tokens": 20} works)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_lib.errors import InputError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.triton_io import Inputs, read_scalar, read_strings

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)

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


@dataclass
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    prepend_input: bool
    """Non-streaming responses start with the prompt unless `exclude_input_in_output` is true."""
    return_flags: dict[str, bool]


def parse_generate_request(
    inputs: Inputs, *, max_prompt_bytes: int, max_logprobs: int, max_n: int
) -> GenerateRequest:
    """Read one request's tensors; InputError names the offending input or field."""
    (prompt,) = _single(
        read_strings(inputs, "text_input", max_bytes=max_prompt_bytes), "text_input"
    )
    if not prompt:
        raise InputError("input 'text_input' is empty: send a non-empty prompt")
    stream = bool(read_scalar(inputs, "stream", bool))
    exclude = read_scalar(inputs, "exclude_input_in_output", bool)
    # As the vLLM backend: streaming never prepends; asking for it explicitly is an error.
    prepend_input = not exclude if exclude is not None else not stream
    if stream and prepend_input:
        raise InputError(
            "when streaming, exclude_input_in_output=false is not allowed: "
            "streamed responses carry only new text"
        )
    fields = _sampling_fields(inputs)
    params = SamplingParams.from_dict(fields, max_logprobs=max_logprobs, max_n=max_n)
    flags = {name: bool(read_scalar(inputs, name, bool)) for name in RETURN_FLAGS}
    return GenerateRequest(prompt, params, stream, prepend_input, flags)


def _single(values: list[str], name: str) -> list[str]:
    if len(values) != 1:
        raise InputError(f"input '{name}' must hold exactly one prompt, got {len(values)}")
    return values


def _sampling_fields(inputs: Inputs) -> dict[str, Any]:
    """The sampling_parameters JSON object, overlaid with the scalar inputs present."""
    fields: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        (text,) = _single(read_strings(inputs, "sampling_parameters"), "sampling_parameters")
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
    return fields
