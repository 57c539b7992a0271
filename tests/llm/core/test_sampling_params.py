"""SamplingParams: vLLM defaults and validation, and parsing of JSON from Triton vLLM-backend clients."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_lib.errors import InputError
from backend_lib.llm.core.sampling_params import SamplingParams, SamplingType


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        -1,
        0.0,
    )
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.0,
        0.0,
        0.0,
    )
    assert (params.seed, params.max_tokens, params.min_tokens, params.logprobs) == (
        None,
        16,
        0,
        None,
    )
    assert (params.stop, params.stop_token_ids) == ([], [])
    assert (params.ignore_eos, params.skip_special_tokens, params.include_stop_str_in_output) == (
        False,
        True,
        False,
    )
    assert params.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1, "temperature must be >= 0, got -1"),
        ("top_p", 2, "top_p must be in (0, 1], got 2"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_k", -2, "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
        ("min_p", 1.5, "min_p must be in [0, 1], got 1.5"),
        ("repetition_penalty", 0, "repetition_penalty must be > 0, got 0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
        ("n", 0, "n must be >= 1, got 0"),
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
        ("logprobs", -1, "logprobs must be >= 0, got -1"),
        ("seed", 2**64, "seed must be in"),
        ("stop", ["ok", ""], "stop must contain non-empty strings"),
        ("stop_token_ids", [3, -1], "stop_token_ids must contain token ids >= 0"),
        ("temperature", math.nan, "temperature must be finite, got nan"),
        ("top_p", math.inf, "top_p must be finite, got inf"),
        ("n", 2.0, "n must be an integer"),
    ],
)
def test_out_of_range_values_name_field_and_range(field, value, message):
    with pytest.raises(InputError) as excinfo:
        SamplingParams(**{field: value})
    assert message in str(excinfo.value)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InputError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_normalisation():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2, seed=1)
    assert greedy.is_greedy and greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=0.5, seed=1).sampling_type is SamplingType.RANDOM_SEED
    with pytest.raises(InputError, match="n must be 1 when using greedy sampling"):
        SamplingParams(temperature=0, n=2)


def test_output_text_buffer_length():
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    assert (
        SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length
        == 0
    )
    assert SamplingParams().output_text_buffer_length == 0


def test_from_dict_parses_strings_as_triton_clients_send_them():
    params = SamplingParams.from_dict(
        {
            "temperature": "0.7",
            "max_tokens": "100",
            "top_k": "50",
            "n": 2,
            "seed": "-3",
            "ignore_eos": "false",
            "skip_special_tokens": "False",
            "include_stop_str_in_output": "true",
            "stop": "###",
            "stop_token_ids": ["7", 8],
            "top_p": 1,
            "logprobs": None,
        }
    )
    assert (params.temperature, params.max_tokens, params.top_k, params.n, params.seed) == (
        0.7,
        100,
        50,
        2,
        -3,
    )
    assert params.ignore_eos is False and params.skip_special_tokens is False
    assert params.include_stop_str_in_output is True
    assert (params.stop, params.stop_token_ids, params.logprobs) == (["###"], [7, 8], None)
    assert SamplingParams.from_dict({"stop": ["a", "b"], "max_tokens": 3.0}).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"temprature": 0.5},
            "unknown sampling parameter 'temprature'; known parameters: frequency_penalty",
        ),
        ({"max_tokens": "ten"}, "max_tokens must be an integer, got 'ten'"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
        ({"n": True}, "n must be an integer, got True"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"temperature": [1]}, "temperature must be a number"),
        ({"ignore_eos": "maybe"}, "ignore_eos must be a boolean (true/false), got 'maybe'"),
        ({"ignore_eos": 0.5}, "ignore_eos must be a boolean"),
        ({"stop": 5}, "stop must be a list"),
        ({"stop": ["a", 5]}, "stop must contain strings"),
        ({"stop_token_ids": "7"}, "stop_token_ids must be a list"),
        ({"temperature": "nan"}, "temperature must be finite"),
        ({"logprobs": 21}, "logprobs must be <= 20, got 21"),
        ({"n": 65}, "n must be <= 64, got 65"),
    ],
)
def test_from_dict_rejects_bad_input(payload, message):
    with pytest.raises(InputError) as excinfo:
        SamplingParams.from_dict(payload, max_logprobs=20, max_n=64)
    assert message in str(excinfo.value)


def test_from_dict_limits_are_configurable():
    assert SamplingParams.from_dict({"logprobs": 30}, max_logprobs=30).logprobs == 30
    with pytest.raises(InputError, match="n must be <= 4"):
        SamplingParams.from_dict({"n": 5}, max_n=4)
    with pytest.raises(InputError, match="must be a JSON object"):
        SamplingParams.from_dict(["n", 1])  # type: ignore[arg-type]


_valid = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 8),
        "temperature": st.floats(0.01, 2.0),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(-1, 100),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-(2**40), 2**40),
        "repetition_penalty": st.floats(0.1, 2.0),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "max_tokens": st.integers(1, 4096),
        "logprobs": st.integers(0, 20),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "stop": st.lists(st.text(min_size=1), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 100000), max_size=3),
    },
)


def _as_strings(payload: dict) -> dict:
    """What a client writing every scalar as a JSON string sends."""

    def text(value):
        if isinstance(value, bool):
            return "true" if value else "false"
        return value if isinstance(value, (str, list)) else repr(value)

    return {key: text(value) for key, value in payload.items()}


@settings(max_examples=100, deadline=None)
@given(payload=_valid)
def test_string_encoded_values_parse_like_native_json(payload):
    native = SamplingParams.from_dict(json.loads(json.dumps(payload)))
    stringly = SamplingParams.from_dict(json.loads(json.dumps(_as_strings(payload))))
    assert stringly == native
    for key, value in payload.items():
        if key not in ("top_k", "top_p", "min_p"):  # normalised (top_k 0 -> -1)
            assert getattr(native, key) == value
    assert dataclasses.asdict(native) == dataclasses.asdict(SamplingParams(**payload))
