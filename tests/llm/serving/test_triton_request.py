import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_lib.errors import InputError
from backend_lib.llm.serving.triton_request import parse_generate_request

LIMITS = dict(max_prompt_bytes=1000, max_logprobs=20, max_n=8)


def text(value: str | bytes) -> np.ndarray:
    raw = value.encode() if isinstance(value, str) else value
    return np.array([raw], dtype=object)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def test_vllm_backend_client_payload_with_string_numbers_and_booleans():
    params = {
        "max_tokens": "100",
        "temperature": "0.7",
        "top_p": "0.9",
        "ignore_eos": "false",
        "skip_special_tokens": "true",
        "stop": "\n\n",
        "seed": "3",
    }
    request = parse_generate_request(
        {
            "text_input": text("Hello"),
            "sampling_parameters": text(json.dumps(params)),
            "exclude_input_in_output": flag(True),
            "return_finish_reason": flag(True),
            "return_num_output_tokens": flag(True),
        },
        **LIMITS,
    )
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.ignore_eos, p.skip_special_tokens) == (
        100,
        0.7,
        0.9,
        False,
        True,
    )
    assert p.stop == ["\n\n"] and p.seed == 3
    assert request.prepend_input is False and request.stream is False
    assert (
        request.return_flags["return_finish_reason"]
        and request.return_flags["return_num_output_tokens"]
    )
    assert not request.return_flags["return_logprobs"]


def test_prepend_defaults_follow_vllm_backend():
    assert parse_generate_request({"text_input": text("a")}, **LIMITS).prepend_input is True
    streaming = parse_generate_request({"text_input": text("a"), "stream": flag(True)}, **LIMITS)
    assert streaming.prepend_input is False and streaming.stream is True
    with pytest.raises(InputError, match="exclude_input_in_output=false is not allowed"):
        parse_generate_request(
            {"text_input": text("a"), "stream": flag(True), "exclude_input_in_output": flag(False)},
            **LIMITS,
        )


def test_scalar_inputs_override_json_fields():
    request = parse_generate_request(
        {
            "text_input": text("a"),
            "sampling_parameters": text('{"max_tokens": 5, "top_k": 3}'),
            "max_tokens": np.array([20], dtype=np.int32),
            "temperature": np.array([0.0], dtype=np.float32),
            "stop_words": np.array([b"END", b"STOP"], dtype=object),
        },
        **LIMITS,
    )
    assert request.params.max_tokens == 20 and request.params.temperature == 0.0
    assert request.params.stop == ["END", "STOP"]


@pytest.mark.parametrize(
    "inputs,fragment",
    [
        ({"text_input": text("")}, "empty"),
        ({}, "missing required input 'text_input'"),
        ({"text_input": text(b"\xff")}, "not valid UTF-8"),
        ({"text_input": text("x" * 1001)}, "over the limit of 1000 bytes"),
        ({"text_input": text("a"), "sampling_parameters": text("{bad json")}, "not valid JSON"),
        ({"text_input": text("a"), "sampling_parameters": text("[1, 2]")}, "must be a JSON object"),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"colour": 1}')},
            "unknown sampling parameter 'colour'",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"temperature": -1}')},
            "temperature must be >= 0",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"top_p": NaN}')},
            "top_p must be finite",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"max_tokens": 0}')},
            "max_tokens must be >= 1",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"n": 99, "temperature": 1}')},
            "n must be <= 8",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"logprobs": 50}')},
            "logprobs must be <= 20",
        ),
        ({"text_input": text("a"), "temperature": np.array([np.inf], dtype=np.float32)}, "finite"),
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, "exactly one prompt"),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"priority": 1.5}')},
            "priority must be an integer",
        ),
        (
            {"text_input": text("a"), "sampling_parameters": text('{"priority": "high"}')},
            "priority must be an integer",
        ),
    ],
)
def test_bad_requests_name_the_problem(inputs, fragment):
    with pytest.raises(InputError) as info:
        parse_generate_request(inputs, **LIMITS)
    assert fragment in str(info.value)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = st.sampled_from(
    [
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "priority",
        "tenant",
        "unknown",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(FIELDS, JSON_VALUES | st.text(max_size=6), max_size=5))
def test_fuzzed_sampling_parameters_parse_or_raise_input_error(fields):
    payload = text(json.dumps(fields))
    try:
        request = parse_generate_request(
            {"text_input": text("hi"), "sampling_parameters": payload}, **LIMITS
        )
    except InputError as exc:
        assert str(exc)
    else:
        request.params.validate(max_logprobs=20, max_n=8)


# --- structured outputs --------------------------------------------------------------------------

_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "structured",
    [json.dumps({"json": _SCHEMA}), {"json": _SCHEMA}, {"json": json.dumps(_SCHEMA)}],
)
def test_structured_outputs_in_sampling_parameters(structured):
    params = {"temperature": 0, "structured_outputs": structured}
    request = parse_generate_request(
        {"text_input": text("Hi"), "sampling_parameters": text(json.dumps(params))}, **LIMITS
    )
    so = request.params.structured_outputs
    assert so.kind == "json" and json.loads(so.text) == _SCHEMA


@pytest.mark.parametrize(
    "guide_type,guide,kind,expected_text",
    [
        ("json", None, "json_object", ""),
        ("json_schema", json.dumps(_SCHEMA), "json", json.dumps(_SCHEMA)),
        ("regex", "[a-z]+", "regex", "[a-z]+"),
        ("ebnf_grammar", 'root ::= "x"', "grammar", 'root ::= "x"'),
    ],
)
def test_guided_decoding_inputs_map_to_structured_outputs(guide_type, guide, kind, expected_text):
    inputs = {"text_input": text("Hi"), "guided_decoding_guide_type": text(guide_type)}
    if guide is not None:
        inputs["guided_decoding_guide"] = text(guide)
    so = parse_generate_request(inputs, **LIMITS).params.structured_outputs
    assert (so.kind, so.text) == (kind, expected_text)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"guided_decoding_guide_type": text("xml")}, "guided_decoding_guide_type' must be one"),
        ({"guided_decoding_guide_type": text("regex")}, "guided_decoding_guide' is required"),
        ({"guided_decoding_guide": text("[a-z]")}, "needs 'guided_decoding_guide_type'"),
        (
            {
                "guided_decoding_guide_type": text("regex"),
                "guided_decoding_guide": text("a"),
                "sampling_parameters": text(json.dumps({"structured_outputs": {"regex": "b"}})),
            },
            "not both",
        ),
        (
            {
                "sampling_parameters": text(
                    json.dumps({"structured_outputs": {"regex": "a", "x": 1}})
                )
            },
            "unknown structured_outputs key 'x'",
        ),
    ],
)
def test_bad_guided_decoding_inputs_name_the_input(extra, message):
    with pytest.raises(InputError, match=message):
        parse_generate_request({"text_input": text("Hi"), **extra}, **LIMITS)


@pytest.mark.parametrize(("value", "expected"), [(None, 0), (-3, -3), ("2", 2), (4.0, 4)])
def test_priority_in_sampling_parameters(value, expected):
    """vLLM's request `priority` (lower first), numbers as strings accepted as for every field;
    absent: 0. It is the request's, not a sampling parameter."""
    params = {"max_tokens": 2} | ({} if value is None else {"priority": value})
    request = parse_generate_request(
        {"text_input": text("a"), "sampling_parameters": text(json.dumps(params))}, **LIMITS
    )
    assert request.priority == expected and request.params.max_tokens == 2


@pytest.mark.parametrize(
    ("params", "expected"), [({}, None), ({"tenant": None}, None), ({"tenant": "acme"}, "acme")]
)
def test_tenant_in_sampling_parameters(params, expected):
    """Who the request is served for (fair share, per-tenant limits and metrics): the request's,
    not a sampling parameter; absent or null: None (the engine then takes its adapter's, or
    default)."""
    payload = text(json.dumps({"max_tokens": 2, **params}))
    request = parse_generate_request(
        {"text_input": text("a"), "sampling_parameters": payload}, **LIMITS
    )
    assert request.tenant == expected and request.params.max_tokens == 2


@pytest.mark.parametrize("value", ["", 3, ["a"], True])
def test_a_bad_tenant_is_refused(value):
    payload = text(json.dumps({"tenant": value}))
    with pytest.raises(InputError, match="tenant must be a non-empty string"):
        parse_generate_request({"text_input": text("a"), "sampling_parameters": payload}, **LIMITS)
