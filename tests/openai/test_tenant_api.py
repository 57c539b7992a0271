"""The tenant through every generating API of the frontend (openai_frontend/tenant.py), against a
stand-in for tritonserver that records what it is sent: a request's `user` (chat, completions,
Responses: the `openai` SDK; Messages' `metadata.user_id`: the `anthropic` SDK) reaches the llm as
`tenant` in its sampling_parameters; with named API keys the key's name does, whatever `user`
says; a wrong key is a 401 and nothing is sent; a bad keys file fails the frontend's start,
naming `api_keys_file`."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from backend_lib import contract
from openai_frontend.config import FrontendConfig, FrontendConfigError
from tests.openai.scripted_triton_helpers import (
    ScriptedTriton,
    scripted_client,
    write_scripted_repository,
)

FACTS = {"llm": contract.ModelFacts(1024)}
MESSAGES = [{"role": "user", "content": "Who goes there?"}]
KEYS = {"gold": "key-of-gold", "free": "key-of-free"}


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    return write_scripted_repository(tmp_path_factory.mktemp("tenant-repo"), ["llm"])


@pytest.fixture
def keys_file(tmp_path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


def openai_sdk(client, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0
    )


def anthropic_sdk(client, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=key, http_client=client, max_retries=0
    )


def sent_tenants(triton: ScriptedTriton) -> list[str | None]:
    return [request["params"].get("tenant") for request in triton.requests]


def every_api(client, key: str = "unused", user: str | None = None) -> None:
    """One request through chat, completions, Responses and Messages, as `user`."""
    sdk = openai_sdk(client, key)
    extra = {} if user is None else {"user": user}
    sdk.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4, **extra)
    sdk.completions.create(model="llm", prompt="ROMEO:", max_tokens=4, **extra)
    sdk.responses.create(model="llm", input="Who goes there?", max_output_tokens=4, **extra)
    metadata = {} if user is None else {"metadata": {"user_id": user}}
    anthropic_sdk(client, key).messages.create(
        model="llm", messages=MESSAGES, max_tokens=4, **metadata
    )


def test_the_user_is_the_tenant_of_every_generating_api(repository):
    triton = ScriptedTriton(FACTS)
    with scripted_client(repository, triton) as client:
        every_api(client, user="alice")
        every_api(client)
    assert sent_tenants(triton) == ["alice"] * 4 + [None] * 4


def test_a_named_key_s_name_is_the_tenant_whatever_the_user_says(repository, keys_file):
    triton = ScriptedTriton(FACTS)
    with scripted_client(
        repository, triton, api_key="plain-key", api_keys_file=keys_file
    ) as client:
        every_api(client, KEYS["gold"], user="mallory")
        every_api(client, KEYS["free"])
        every_api(client, "plain-key", user="carol")  # the unnamed key: its user's
    assert sent_tenants(triton) == ["gold"] * 4 + ["free"] * 4 + ["carol"] * 4


def test_a_wrong_key_is_a_401_and_nothing_is_sent(repository, keys_file):
    triton = ScriptedTriton(FACTS)
    with scripted_client(repository, triton, api_keys_file=keys_file) as client:
        with pytest.raises(openai.AuthenticationError):
            openai_sdk(client, "key-of-nobody").chat.completions.create(
                model="llm", messages=MESSAGES, max_tokens=4
            )
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_sdk(client, "key-of-nobody").messages.create(
                model="llm", messages=MESSAGES, max_tokens=4
            )
        assert client.get("/health").status_code == 200  # open paths stay open
    assert triton.requests == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "cannot read it as JSON"),
        ("{}", "non-empty JSON object"),
        ('{"a": ""}', "key 'a': expected a non-empty string"),
        ('{"a": 3}', "key 'a': expected a non-empty string"),
        ('{"a": "k", "b": "k"}', "two names share one key"),
    ],
)
def test_a_bad_keys_file_names_the_setting(tmp_path, text, reason):
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(FrontendConfigError, match=reason) as caught:
        FrontendConfig(api_keys_file=path)
    assert caught.value.field == "api_keys_file"
