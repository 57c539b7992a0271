"""Against a real tritonserver: the frontend shows the limits and adapters each llm version's engine
decided at load, not its own reading of parameters, checkpoints or multi_lora.json; and a model's
error reaches a gRPC stream with its code. One llm, two versions side by side: version 1 on the
Shakespeare checkpoint (max_position_embeddings 1024), version 2 on the same weights with a
config.json that has no max_position_embeddings (the engine then takes its default); LoRA enabled
as `on`, with the sonnets adapter."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend_lib import contract
from backend_lib.config import ConfigError
from backend_lib.llm.lora.registry import read_multi_lora
from tests.e2e.llm_client import grpc_stream
from tests.openai.frontend_helpers import Frontend, start_frontend, stop_frontend
from tests.openai.references import llm_generate
from tests.server_helpers import start_server, stop_server
from tooling.repository import REPO_ROOT, ModelSpec, write_model
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"
SONNETS = REPO_ROOT / "models" / "shakespeare-sonnets-lora"
ENGINE_DEFAULT_MAX_MODEL_LEN = 2048
"""What the engine serves a checkpoint without max_position_embeddings with (max_model_len 0)."""
GREEDY = {"temperature": 0, "max_tokens": 8}


def _without_max_positions(target: Path) -> None:
    """The Shakespeare checkpoint with no max_position_embeddings in its config.json."""
    target.mkdir(parents=True)
    for item in SHAKESPEARE.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item)
    config = json.loads((SHAKESPEARE / "config.json").read_text())
    del config["max_position_embeddings"]
    (target / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[TritonServer, Frontend, Path]]:
    repository = tmp_path_factory.mktemp("facts-repo")
    spec = ModelSpec(
        "llm",
        "llm",
        {
            "model": "{version}/checkpoint",
            "dtype": "float32",
            "cpu_kv_cache_gb": "0.05",
            "max_num_seqs": "4",
            "enable_lora": "on",
            "max_lora_rank": "16",
        },
        versions=(1, 2),
        max_batch_size=0,
        version_policy="all: {}",
        lora_modules={"sonnets": str(SONNETS)},
    )
    write_model(spec, repository)
    (repository / "llm" / "1" / "checkpoint").symlink_to(SHAKESPEARE)
    _without_max_positions(repository / "llm" / "2" / "checkpoint")
    server = start_server(repository)
    try:
        frontend = start_frontend(server.grpc_url, repository, "--index-ttl", "0.2")
    except BaseException:
        stop_server(server)
        raise
    yield server, frontend, repository
    stop_frontend(frontend)
    stop_server(server)


def _models(frontend: Frontend) -> dict[str, dict]:
    reply = httpx.get(f"{frontend.url}/v1/models", timeout=60)
    assert reply.status_code == 200, reply.text
    return {model["id"]: model for model in reply.json()["data"]}


def _facts(server: TritonServer, version: str) -> contract.ModelFacts:
    """The facts a version publishes, asked directly over gRPC."""
    result = grpc_stream(server.grpc_url, "", model_version=version, flags=(contract.DESCRIBE,))
    assert result.error is None, result.error
    (record,) = result.responses
    return contract.ModelFacts.from_json(record[contract.MODEL_FACTS][0])


def test_max_model_len_is_the_engines_per_version(live):
    server, frontend, _ = live
    assert _facts(server, "1").max_model_len == 1024  # the checkpoint's max_position_embeddings
    assert _facts(server, "2").max_model_len == ENGINE_DEFAULT_MAX_MODEL_LEN
    llm = _models(frontend)["llm"]
    assert (llm["version"], llm["max_model_len"]) == ("2", ENGINE_DEFAULT_MAX_MODEL_LEN)
    # The engine itself enforces that limit: one token more is refused, naming it.
    too_many = {"model": "llm", "prompt": "ROMEO:", "max_tokens": ENGINE_DEFAULT_MAX_MODEL_LEN + 1}
    reply = httpx.post(f"{frontend.url}/v1/completions", json=too_many, timeout=60)
    assert reply.status_code == 400, reply.text
    assert f"max_model_len ({ENGINE_DEFAULT_MAX_MODEL_LEN})" in reply.json()["error"]["message"]


def test_adapters_of_enable_lora_on_are_listed_and_served(live):
    server, frontend, _ = live
    assert _facts(server, "2").lora_adapters == ("sonnets",)
    models = _models(frontend)
    assert models["sonnets"]["parent"] == "llm"
    assert models["sonnets"]["max_model_len"] == ENGINE_DEFAULT_MAX_MODEL_LEN
    expected, _ = llm_generate(server, "ROMEO:", {**GREEDY, "lora_name": "sonnets"})
    body = {"model": "sonnets", "prompt": "ROMEO:", **GREEDY}
    reply = httpx.post(f"{frontend.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected[0]


def test_a_streamed_error_reaches_the_client_with_its_code(live):
    server, frontend, _ = live
    result = grpc_stream(server.grpc_url, "ROMEO:", {"max_tokens": 5000})
    code, message = contract.decode_error(result.error or "")
    assert code is contract.ErrorCode.INVALID_INPUT and "max_model_len" in message
    result = grpc_stream(server.grpc_url, "ROMEO:", {"lora_name": "ghost"})
    assert contract.decode_error(result.error or "")[0] is contract.ErrorCode.INVALID_INPUT
    body = {"model": "llm:ghost", "prompt": "ROMEO:"}
    assert httpx.post(f"{frontend.url}/v1/completions", json=body).status_code == 404


def test_a_listing_edited_after_load_changes_neither_side(live):
    """multi_lora.json is read once, by the backend at load: a malformed file written later is
    what the backend would refuse at its next load, and the frontend keeps serving what the
    running engine serves."""
    server, frontend, repository = live
    for version in ("1", "2"):
        (repository / "llm" / version / "multi_lora.json").write_text('{"ghost": ')
        with pytest.raises(ConfigError, match="not valid JSON"):
            read_multi_lora(repository / "llm" / version, repository / "llm")
    time.sleep(0.5)  # past the frontend's index TTL: it refreshes
    models = _models(frontend)
    assert "sonnets" in models and "ghost" not in models
    body = {"model": "sonnets", "prompt": "ROMEO:", **GREEDY}
    reply = httpx.post(f"{frontend.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
