"""LoRA adapters through the frontend: each adapter in the llm's `multi_lora.json` is a model of its
own (under its name, and as `<llm>:<adapter>`), answered by the llm with `lora_name`, as vLLM
serves LoRA modules. Checked against the llm called directly over gRPC."""

from __future__ import annotations

import json

import openai
import pytest

from tests.openai.references import CHAT_MESSAGES, SHAKESPEARE_CHAT, llm_generate
from tests.server_helpers import DEFAULT_REPOSITORY

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0, "max_tokens": 24}
ADAPTERS = sorted(json.loads((DEFAULT_REPOSITORY / "llm" / "1" / "multi_lora.json").read_text()))


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def test_the_default_llm_ships_an_adapter():
    assert ADAPTERS  # the default repository lists one (models/shakespeare-sonnets-lora)


def test_adapters_are_listed_as_models_with_their_parent(sdk):
    models = {m.id: m for m in sdk.models.list().data}
    for adapter in ADAPTERS:
        assert models[adapter].model_extra["parent"] == "llm"
        assert models[adapter].model_extra["kind"] == "llm"
        assert sdk.models.retrieve(f"llm:{adapter}").id == f"llm:{adapter}"
    assert models["llm"].model_extra["parent"] is None


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_chat_with_an_adapter_equals_the_llm_with_lora_name(sdk, server, adapter):
    expected, reasons = llm_generate(server, SHAKESPEARE_CHAT, {**GREEDY, "lora_name": adapter})
    base, _ = llm_generate(server, SHAKESPEARE_CHAT, GREEDY)
    assert expected != base  # the adapter really changes the output
    for model_id in (adapter, f"llm:{adapter}"):
        reply = sdk.chat.completions.create(model=model_id, messages=CHAT_MESSAGES, **GREEDY)
        assert reply.model == model_id
        assert reply.choices[0].message.content == expected[0]
        assert reply.choices[0].finish_reason == reasons[0]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_streamed_completion_with_an_adapter_equals_the_llm_with_lora_name(sdk, server, adapter):
    expected, _ = llm_generate(server, "ROMEO:", {**GREEDY, "lora_name": adapter})
    stream = sdk.completions.create(model=adapter, prompt="ROMEO:", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected[0]


def test_an_unknown_adapter_is_a_404(sdk):
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.chat.completions.create(model="llm:no-such-adapter", messages=CHAT_MESSAGES, **GREEDY)
    assert raised.value.body["param"] == "model"
    assert "llm:no-such-adapter" in raised.value.body["message"]
