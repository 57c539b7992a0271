"""The OpenAI frontend's real routes over a stand-in for tritonserver whose llms "write" fixed
texts: `ScriptedTriton` (the TritonClient calls the routes make), a repository of llms for it to
describe, and an in-process app with the openai SDK on top."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient

from backend_lib import contract
from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from openai_frontend.triton import LLMResponse
from tooling.repository import REPO_ROOT, ModelSpec, read_config, render_config, write_model

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"


def scripted_llm(name: str) -> ModelSpec:
    return ModelSpec(name, "llm", {"model": str(SHAKESPEARE)}, max_batch_size=0)


def write_scripted_repository(path: Path, names: list[str]) -> Path:
    """A repository of llms on the Shakespeare checkpoint (the frontend reads their tokenizer)."""
    for name in names:
        write_model(scripted_llm(name), path)
    return path


class ScriptedTriton:
    """Each llm writes `outputs` (one per choice), `piece` characters per streamed response, and
    finishes with `reason`; `facts` is what each llm publishes."""

    def __init__(self, facts: dict[str, contract.ModelFacts], piece: int = 3) -> None:
        self.facts = facts
        self.piece = piece
        self.outputs = ["Good morrow."]
        self.reason = "stop"
        self.requests: list[dict[str, Any]] = []

    @property
    def output(self) -> str:
        return self.outputs[0]

    @output.setter
    def output(self, text: str) -> None:
        self.outputs = [text]

    @property
    def prompts(self) -> list[str]:
        return [request["prompt"] for request in self.requests]

    async def repository_index(self) -> list[dict[str, Any]]:
        return [{"name": name, "version": "1", "state": "READY"} for name in self.facts]

    async def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return read_config(render_config(scripted_llm(name)))

    async def model_facts(self, name: str, version: str) -> contract.ModelFacts:
        return self.facts[name]

    async def generate(
        self, model, prompt, sampling_parameters, *, stream, logprobs=False, version="", images=None
    ):
        self.requests.append({"model": model, "prompt": prompt, "params": sampling_parameters})
        outputs = list(self.outputs)
        longest = max(len(text) for text in outputs)
        size = self.piece if stream else max(longest, 1)
        starts = list(range(0, longest, size)) or [0]
        for k, start in enumerate(starts):
            last = k == len(starts) - 1
            texts = [text[start : start + size] for text in outputs]
            reasons = [self.reason if last else None for _ in outputs]
            yield LLMResponse(texts, reasons, [1] * len(outputs), 7, [None] * len(outputs), last)

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@contextmanager
def scripted_client(
    repository: Path, triton: ScriptedTriton, **config: Any
) -> Iterator[TestClient]:
    """The frontend app in this process, calling `triton` instead of a tritonserver; `config`:
    more FrontendConfig settings."""
    app = create_app(
        FrontendConfig(triton_url="127.0.0.1:1", model_repository=repository, **config)
    )
    app.state.frontend.triton = app.state.frontend.registry.triton = triton
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def scripted_sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )
