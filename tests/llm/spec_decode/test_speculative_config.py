"""SpeculativeConfig.from_json: each valid form with its defaults, each invalid one naming its field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from backend_lib.config import ConfigError
from backend_lib.llm.speculative_config import (
    DEFAULT_PROMPT_LOOKUP,
    MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
)


def parse(**fields) -> SpeculativeConfig | None:
    return SpeculativeConfig.from_json(json.dumps(fields))


@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_empty_means_no_speculation(text):
    assert SpeculativeConfig.from_json(text) is None


def test_ngram_defaults():
    config = parse(method="ngram", num_speculative_tokens=4)
    assert config == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=4,
        prompt_lookup_max=DEFAULT_PROMPT_LOOKUP,
        prompt_lookup_min=DEFAULT_PROMPT_LOOKUP,
    )
    assert DEFAULT_PROMPT_LOOKUP == 5
    assert config.model is None
    assert config.speculative_disable_by_batch_size is None


def test_ngram_only_max_given_min_follows():
    config = parse(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)


def test_ngram_only_min_given_max_follows():
    config = parse(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)


def test_ngram_both_bounds():
    config = parse(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=4
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 4)


def test_ngram_null_bounds_take_defaults():
    config = parse(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=None, prompt_lookup_max=7
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (7, 7)


def test_draft_model():
    config = parse(method="draft_model", model="draft", num_speculative_tokens=5)
    assert config == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=5, model="draft"
    )
    assert config.prompt_lookup_min is None and config.prompt_lookup_max is None


@pytest.mark.parametrize("quantization", [None, "auto", "none", "int8", "fp8"])
def test_draft_model_quantization(quantization):
    config = parse(model="draft", num_speculative_tokens=2, quantization=quantization)
    assert config.quantization == quantization  # fp8's device check comes at load


def test_method_inferred_from_model():
    config = parse(model="draft", num_speculative_tokens=2)
    assert config.method == "draft_model"


def test_bounds_of_num_speculative_tokens_accepted():
    assert parse(method="ngram", num_speculative_tokens=1).num_speculative_tokens == 1
    config = parse(method="ngram", num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    assert config.num_speculative_tokens == MAX_SPECULATIVE_TOKENS == 16


@pytest.mark.parametrize("key", ["speculative_disable_by_batch_size", "disable_by_batch_size"])
def test_disable_by_batch_size(key):
    config = parse(method="ngram", num_speculative_tokens=2, **{key: 4})
    assert config.speculative_disable_by_batch_size == 4
    assert config.enabled_for(1) and config.enabled_for(4)
    assert not config.enabled_for(5)


def test_never_disabled_by_default():
    config = parse(method="ngram", num_speculative_tokens=2)
    assert config.enabled_for(10_000)


def test_frozen():
    config = parse(method="ngram", num_speculative_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_speculative_tokens = 3


NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
DRAFT = {"method": "draft_model", "model": "draft", "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "[ngram]", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": 3, "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        (
            {**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
            "speculative_config.num_speculative_tokens",
        ),
        ({**NGRAM, "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 4.0}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": None}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_min": "2"}, "speculative_config.prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": 1.5}, "speculative_config.prompt_lookup_max"),
        (
            {**NGRAM, "prompt_lookup_max": MAX_PROMPT_LOOKUP + 1},
            "speculative_config.prompt_lookup_max",
        ),
        (
            {**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max",
        ),
        ({**NGRAM, "model": "draft"}, "speculative_config.model"),
        ({**DRAFT, "model": ""}, "speculative_config.model"),
        ({**DRAFT, "model": 5}, "speculative_config.model"),
        ({**DRAFT, "model": None}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({**DRAFT, "prompt_lookup_min": 2}, "speculative_config.prompt_lookup_min"),
        ({**DRAFT, "quantization": "int4"}, "speculative_config.quantization"),
        ({**DRAFT, "quantization": 8}, "speculative_config.quantization"),
        ({**NGRAM, "quantization": "int8"}, "speculative_config.quantization"),
        ({**DRAFT, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
        (
            {**NGRAM, "speculative_disable_by_batch_size": 1},
            "speculative_config.speculative_disable_by_batch_size",
        ),
        (
            {**NGRAM, "speculative_disable_by_batch_size": "8"},
            "speculative_config.speculative_disable_by_batch_size",
        ),
        (
            {**NGRAM, "disable_by_batch_size": 0},
            "speculative_config.speculative_disable_by_batch_size",
        ),
        (
            {**NGRAM, "disable_by_batch_size": 4, "speculative_disable_by_batch_size": 4},
            "speculative_config.speculative_disable_by_batch_size",
        ),
        ({**NGRAM, "num_lookahead_slots": 2}, "speculative_config.num_lookahead_slots"),
        (
            {**DRAFT, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size",
        ),
    ],
)
def test_invalid_field_is_named(fields, key):
    with pytest.raises(ConfigError) as caught:
        SpeculativeConfig.from_json(json.dumps(fields))
    assert caught.value.key == key
    assert f"'{key}'" in str(caught.value)


@pytest.mark.parametrize("text", ["{", "ngram", "[1, 2]", '"ngram"', "4", "null", "{'a': 1}"])
def test_invalid_json_names_the_parameter(text):
    with pytest.raises(ConfigError) as caught:
        SpeculativeConfig.from_json(text)
    assert caught.value.key == "speculative_config"
    assert "'speculative_config'" in str(caught.value)


def test_unknown_method_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="ngram, draft_model"):
        parse(method="medusa", num_speculative_tokens=2)


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match="known: .*num_speculative_tokens"):
        parse(method="ngram", num_speculative_tokens=2, typo=1)
