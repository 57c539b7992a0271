"""Bad structured_outputs constraints: each refused at submission with an InputError naming the
field (shape errors from SamplingParams, compile errors from the engine), while a concurrent
constrained request runs to a correct end and no KV block or grammar state leaks."""

from __future__ import annotations

import json
import re

import pytest

from backend_lib.errors import InputError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.structured.params import MAX_CONSTRAINT_CHARS
from tests.llm.engine_helpers import assert_pool_released, make_engine
from tests.llm.structured.structured_helpers import REGEX, byte_level_checkpoint

_HUGE_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_CONSTRAINT_CHARS // 20)},
}

# (structured_outputs as sent, a regex the error message must match)
INVALID = [
    ('{"json": {"type": "object"', r"structured_outputs is not valid JSON"),  # broken JSON text
    ({"json": '{"type": "object", '}, r"structured_outputs\.json is not valid JSON"),
    ({"json": {"type": "no-such-type"}}, r"structured_outputs\.json cannot be compiled.*no-such"),
    ({"json": [1, 2]}, r"structured_outputs\.json must be a JSON schema object"),
    ({"json": {"$ref": "#/$defs/missing"}}, r"structured_outputs\.json cannot be compiled"),
    ({"json": {"type": "string", "minLength": "x"}}, r"structured_outputs\.json cannot be comp"),
    ({"jsn": {"type": "object"}}, r"unknown structured_outputs key 'jsn'"),
    ({"regex": "a(b"}, r"structured_outputs\.regex cannot be compiled.*parenthesis"),
    ({"regex": ""}, r"structured_outputs\.regex must be a non-empty string"),
    ({"choice": []}, r"structured_outputs\.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, r"structured_outputs\.choice must hold non-empty strings"),
    ({"grammar": 'root ::= "a" |'}, r"structured_outputs\.grammar cannot be compiled.*EBNF"),
    ({"grammar": 'start ::= "a"'}, r"structured_outputs\.grammar cannot be compiled.*root"),
    ({"regex": "a+", "choice": ["a"]}, r"exactly one of .*got regex, choice"),
    ({}, r"exactly one of .*got none"),
    ({"json_object": "yes"}, r"structured_outputs\.json_object must be true"),
    ({"json": _HUGE_SCHEMA}, r"structured_outputs\.json is \d+ characters long; the limit is "),
    ({"regex": "a+", "disable_any_whitespace": True}, r"disable_any_whitespace applies to json"),
    ({"json": {}, "whitespace_pattern": " ?"}, r"whitespace_pattern is not supported"),
    (["regex", "a"], r"structured_outputs must be a JSON object"),
]


def test_each_invalid_constraint_is_refused_while_a_constrained_request_completes():
    assert len(INVALID) >= 10
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    good = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"regex": REGEX})
    engine.add_request("good", "KING:", good)
    final = None
    for i, (constraint, message) in enumerate(INVALID):
        with pytest.raises(InputError, match=message):
            # As the Triton request parser builds them (from the sampling_parameters JSON).
            params = SamplingParams.from_dict({"temperature": 0, "structured_outputs": constraint})
            engine.add_request(f"bad-{i}", "KING:", params)
        for out in engine.step():
            final = out if out.finished else final
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and final.request_id == "good" and final.error is None
    assert final.outputs[0].finish_reason == "stop" and re.fullmatch(REGEX, final.outputs[0].text)
    assert len(engine.structured) == 0
    assert_pool_released(engine)


def test_structured_outputs_arrives_as_json_text_or_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_text = SamplingParams.from_dict({"structured_outputs": json.dumps({"json": schema})})
    as_object = SamplingParams.from_dict({"structured_outputs": {"json": json.dumps(schema)}})
    assert as_text.structured_outputs == as_object.structured_outputs
    assert as_text.structured_outputs.kind == "json"
    choice = SamplingParams.from_dict({"structured_outputs": {"choice": ['say "ay"', "no\\"]}})
    assert choice.structured_outputs.kind == "choice"
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    (out,) = engine.generate(
        ["KING:"],
        SamplingParams(
            temperature=0, max_tokens=20, **{"structured_outputs": choice.structured_outputs}
        ),
    )
    assert out.outputs[0].text in ('say "ay"', "no\\")  # quotes and backslashes escaped
