"""backend_lib/contract.py is the one source of what the backend and the frontend share: model kinds,
tensor names, boolean spelling, error codes and published facts. These tests hold every side to it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend_lib import contract
from backend_lib.config import ConfigError, parse_bool
from backend_lib.contract import ErrorCode, decode_error, encode_error, model_kind
from backend_lib.errors import InputError, QueueFullError, RequestCancelled, response_error
from tooling.repository import DEFAULT_MODELS, ModelSpec, read_config, render_config

SPELLINGS = [("true", True), ("On", True), (" yes ", True), ("1", True), (True, True)] + [
    ("false", False),
    ("OFF", False),
    ("no", False),
    ("0", False),
    (False, False),
]


def test_the_contract_imports_without_torch_or_tritonclient():
    code = (
        "import sys, backend_lib.contract, backend_lib.errors, openai_frontend.app; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("raw,value", SPELLINGS)
def test_one_boolean_spelling_for_every_side(raw, value):
    assert contract.parse_bool(raw) is value
    assert parse_bool("enable_lora", raw) is value  # the backend's config parser
    spec = ModelSpec("m", "llm", {"enable_lora": str(raw)})
    assert spec.writes_multi_lora is value  # tooling writes multi_lora.json as the backend reads


def test_a_bad_boolean_is_refused_by_every_side():
    with pytest.raises(ValueError):
        contract.parse_bool("maybe")
    with pytest.raises(ConfigError, match="enable_lora"):
        parse_bool("enable_lora", "maybe")


# --- kinds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", DEFAULT_MODELS, ids=lambda s: s.kind)
def test_every_rendered_template_is_told_apart_by_model_kind(spec):
    assert model_kind(read_config(render_config(spec))) == spec.kind


def test_frontend_and_scripts_use_the_one_model_kind():
    import openai_frontend.discovery
    import scripts.serve

    assert openai_frontend.discovery.model_kind is contract.model_kind
    assert scripts.serve.model_kind is contract.model_kind


def test_model_kind_of_configs_that_are_no_kind():
    llm_like = {"output": [{"name": "text_output"}]}  # not decoupled: not the llm
    assert model_kind(llm_like) is None
    decoupled = {"model_transaction_policy": {"decoupled": True}, "output": [{"name": "x"}]}
    assert model_kind(decoupled) is None  # scripts/serve.py called this an llm
    score_only = {"input": [{"name": "a"}], "output": [{"name": "score"}]}
    assert model_kind(score_only) is None


# --- tensor names ----------------------------------------------------------------------------


def _names(items):
    return [item["name"] for item in items]


def test_the_llm_template_declares_the_contract_tensors():
    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    config = read_config(render_config(spec))
    inputs, outputs = _names(config["input"]), _names(config["output"])
    for name in (
        contract.TEXT_INPUT,
        contract.STREAM,
        contract.SAMPLING_PARAMETERS,
        contract.EXCLUDE_INPUT_IN_OUTPUT,
        contract.DESCRIBE,
        *contract.RETURN_FLAGS,
    ):
        assert name in inputs
    assert outputs == [*contract.LLM_OUTPUTS, contract.MODEL_FACTS]
    for flag in contract.RETURN_FLAGS:
        assert flag.removeprefix("return_") in outputs


@pytest.mark.parametrize("kind", ["embedding", "rerank"])
def test_the_encoder_templates_declare_the_contract_outputs(kind):
    spec = next(s for s in DEFAULT_MODELS if s.kind == kind)
    config = read_config(render_config(spec))
    assert tuple(_names(config["output"])) == contract.ENCODER_OUTPUTS[kind]


def test_the_frontend_and_the_request_parser_share_the_return_flags():
    from backend_lib.llm.serving import triton_request
    from openai_frontend.triton import LLM_FLAGS

    assert triton_request.RETURN_FLAGS is contract.RETURN_FLAGS
    assert set(LLM_FLAGS) <= set(contract.RETURN_FLAGS)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_codec_round_trip(code):
    text = encode_error(code, "something: [x] went wrong")
    assert decode_error(text) == (code, "something: [x] went wrong")


@pytest.mark.parametrize(
    "text",
    [
        "plain text",
        "[request id: <id_unknown>] unexpected inference input 'x'",
        "[nonsense] text",
        "[invalid_input]no space",
        "ValueError: [queue_full] later",
    ],
)
def test_text_without_a_code_decodes_to_none(text):
    assert decode_error(text) == (None, text)


class Boom(Exception):
    """An internal failure whose type name does not end in Error."""


@pytest.mark.parametrize(
    "exc,triton_code,code",
    [
        (InputError("ValueError: max_tokens is bad"), "INVALID_ARG", ErrorCode.INVALID_INPUT),
        (InputError("request r was cancelled"), "INVALID_ARG", ErrorCode.INVALID_INPUT),
        (QueueFullError("queue full: 3 requests waiting"), "UNAVAILABLE", ErrorCode.QUEUE_FULL),
        (RequestCancelled("request r was cancelled"), "CANCELLED", ErrorCode.CANCELLED),
        (RuntimeError("generation failed: x"), "INTERNAL", ErrorCode.INTERNAL),
        (Boom("invalid prompt"), "INTERNAL", ErrorCode.INTERNAL),
    ],
)
def test_response_errors_carry_their_code(exc, triton_code, code):
    name, message = response_error(exc)
    assert name == triton_code == contract.TRITON_ERROR_CODES[code]
    decoded, text = decode_error(message)
    assert decoded is code
    assert str(exc) in text
    if code is ErrorCode.INTERNAL:
        assert text.startswith(type(exc).__name__ + ": ")


def test_every_code_has_a_triton_code():
    assert set(contract.TRITON_ERROR_CODES) == set(ErrorCode)


# --- facts -----------------------------------------------------------------------------------


def test_facts_round_trip():
    facts = contract.ModelFacts(2048, ("a", "b"))
    assert contract.ModelFacts.from_json(facts.to_json()) == facts
    assert contract.ModelFacts.from_json(b"{}") == contract.ModelFacts()


@pytest.mark.parametrize(
    "text", ["", "[]", '{"max_model_len": "1"}', '{"lora_adapters": [1]}', "{bad"]
)
def test_malformed_facts_are_refused(text):
    with pytest.raises(ValueError):
        contract.ModelFacts.from_json(text)


def test_facts_carry_the_image_limits_and_refuse_bad_ones():
    facts = contract.ModelFacts(2048, max_images=4, max_image_bytes=1024)
    assert contract.ModelFacts.from_json(facts.to_json()) == facts
    for bad in ('{"max_images": -1}', '{"max_image_bytes": "big"}', '{"max_images": true}'):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            contract.ModelFacts.from_json(bad)
