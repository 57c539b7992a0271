"""A frontend in front of a tritonserver under explicit model control: a model loaded or unloaded
in Triton appears in or disappears from `/v1/models` without restarting the frontend; and a burst
beyond the llm's tiny `max_num_seqs` + `max_queue_size` gets 429s with `Retry-After` in OpenAI's
error shape, while the accepted requests complete correctly. One server for both. And the
frontend finds the tokenizer of an llm given as a directory plus `gguf_file`, as the backend
does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient

from tests.openai.references import llm_generate, wait_engine_idle
from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model

pytestmark = pytest.mark.e2e

TINY_QUEUE = {"max_num_seqs": "2", "max_queue_size": "1", "cpu_kv_cache_gb": "0.05"}
"""Two sequences running and one waiting at most: the rest of a burst is refused."""
BURST = 10
PARAMS = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}


def write_repository(repository: Path) -> None:
    """`llm` (the default llm with a tiny queue) and `llm_spare` (loaded later by the test)."""
    spec = next(s for s in DEFAULT_MODELS if s.kind == "llm")
    parameters = {**spec.parameters, "model": str(REPO_ROOT / "models" / "shakespeare-llama")}
    write_model(ModelSpec("llm", "llm", {**parameters, **TINY_QUEUE}, max_batch_size=0), repository)
    spare = {**parameters, "cpu_kv_cache_gb": "0.05", "max_num_seqs": "4"}
    write_model(ModelSpec("llm_spare", "llm", spare, max_batch_size=0), repository)


def served_models(http: httpx.Client) -> set[str]:
    """The listed plain names (each version's pinned `<name>:<version>` id left out)."""
    response = http.get("/v1/models")
    assert response.status_code == 200, response.text
    return {model["id"] for model in response.json()["data"] if ":" not in model["id"]}


def wait_for_models(http: httpx.Client, expected: set[str], timeout: float = 20) -> set[str]:
    deadline = time.monotonic() + timeout
    while (models := served_models(http)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return models


async def burst(url: str) -> list[httpx.Response]:
    body = {"model": "llm", "prompt": "ROMEO:", **PARAMS}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await asyncio.gather(
            *(http.post("/v1/completions", json=body) for _ in range(BURST))
        )


def test_models_follow_triton_and_a_full_queue_is_429(tmp_path, make_server, make_frontend):
    write_repository(tmp_path)
    # A short exit timeout: after this test's unload and refused burst, Triton's shutdown otherwise
    # waits out its default 30 s (shutdown is not what is tested here).
    server = make_server(
        tmp_path,
        ["--model-control-mode=explicit", "--load-model=llm", "--exit-timeout-secs=3"],
    )
    frontend = make_frontend(server.grpc_url, tmp_path, "--index-ttl", "0.5")
    triton = httpclient.InferenceServerClient(server.http_url)

    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        # Discovery: load and unload in Triton, the same frontend process follows.
        assert served_models(http) == {"llm"}
        assert http.get("/v1/models/llm_spare").status_code == 404
        triton.load_model("llm_spare")
        assert wait_for_models(http, {"llm", "llm_spare"}) == {"llm", "llm_spare"}
        reply = http.post(
            "/v1/completions", json={"model": "llm_spare", "prompt": "ROMEO:", "max_tokens": 4}
        )
        assert reply.status_code == 200, reply.text
        triton.unload_model("llm_spare")
        assert wait_for_models(http, {"llm"}) == {"llm"}
        gone = http.post(
            "/v1/completions", json={"model": "llm_spare", "prompt": "ROMEO:", "max_tokens": 4}
        )
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
        assert frontend.process.poll() is None  # never restarted

    # Overload: a burst beyond 2 running + 1 waiting.
    responses = asyncio.run(burst(frontend.url))
    refused = [r for r in responses if r.status_code == 429]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(accepted) == BURST, [r.status_code for r in responses]
    assert refused and accepted
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "rate_limit_error" and error["code"] == 429
        assert "queue full" in error["message"]
    expected = llm_generate(server, "ROMEO:", PARAMS)[0][0]
    for response in accepted:
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (expected, "length")
        assert response.json()["usage"]["completion_tokens"] == PARAMS["max_tokens"]
    assert wait_engine_idle(server) == (0, 0)


def test_the_frontend_reads_the_tokenizer_of_a_directory_with_gguf_file(tmp_path, monkeypatch):
    from backend_lib.gguf_checkpoint import materialize
    from openai_frontend.discovery import ModelInfo
    from tests.llm.shakespeare_helpers import SHAKESPEARE
    from tooling.gguf_checkpoints import write_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", "F16")
    parameters = {"model": str(tmp_path), "gguf_file": path.name}
    info = ModelInfo("llm", "1", "llm", parameters, tmp_path)
    assert info.checkpoint() == materialize(path, str(path))
