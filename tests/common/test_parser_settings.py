"""The llm's `tool_call_parser` and `reasoning_parser`: checked at load against the contract's
names (a bad one fails the load with a ConfigError naming the field), and published in the
model's facts, whose JSON keeps them and refuses unknown names."""

from __future__ import annotations

import pytest

from backend_lib import contract
from backend_lib.config import ConfigError, from_parameters
from backend_lib.llm.config import LLMConfig


def test_parsers_default_to_none():
    config = from_parameters(LLMConfig, {})
    assert config.tool_call_parser is None and config.reasoning_parser is None
    assert from_parameters(LLMConfig, {"tool_call_parser": "none"}).tool_call_parser is None
    assert from_parameters(LLMConfig, {"reasoning_parser": ""}).reasoning_parser is None


@pytest.mark.parametrize("name", contract.TOOL_CALL_PARSERS)
def test_every_tool_call_parser_name_loads(name):
    assert from_parameters(LLMConfig, {"tool_call_parser": name}).tool_call_parser == name


@pytest.mark.parametrize("name", contract.REASONING_PARSERS)
def test_every_reasoning_parser_name_loads(name):
    assert from_parameters(LLMConfig, {"reasoning_parser": name}).reasoning_parser == name


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tool_call_parser", "hermes2"),
        ("tool_call_parser", "Hermes"),
        ("tool_call_parser", "deepseek_r1"),
        ("reasoning_parser", "qwen3_xml"),
        ("reasoning_parser", "think"),
    ],
)
def test_an_unknown_parser_fails_the_load_naming_the_field(key, value):
    with pytest.raises(ConfigError) as info:
        from_parameters(LLMConfig, {key: value})
    assert info.value.key == key
    assert f"'{key}'={value!r}" in str(info.value) and "expected one of" in str(info.value)


def test_facts_carry_the_parsers():
    facts = contract.ModelFacts(1024, ("sonnets",), "hermes", "qwen3")
    assert contract.ModelFacts.from_json(facts.to_json()) == facts
    old = contract.ModelFacts.from_json('{"max_model_len": 8, "lora_adapters": []}')
    assert old.tool_call_parser is None and old.reasoning_parser is None  # an older llm's facts


@pytest.mark.parametrize(
    "text",
    [
        '{"tool_call_parser": "hermes2"}',
        '{"tool_call_parser": 1}',
        '{"reasoning_parser": "hermes"}',
        '{"reasoning_parser": ["qwen3"]}',
    ],
)
def test_facts_with_an_unknown_parser_are_refused(text):
    with pytest.raises(ValueError, match="parser"):
        contract.ModelFacts.from_json(text)
