"""A stand-in for tritonserver's client (`openai_frontend.triton.TritonClient`): the calls the
routes make, answered from rendered configs and given facts, for frontend tests without a server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from backend_lib import contract
from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from openai_frontend.triton import LLMResponse
from tooling.repository import REPO_ROOT, ModelSpec, read_config, render_config

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"


class FakeTriton:
    """The TritonClient calls the routes make, answered from rendered configs and given facts."""

    def __init__(self, specs: list[ModelSpec], facts: dict[tuple[str, str], contract.ModelFacts]):
        self.specs = {spec.name: spec for spec in specs}
        self.facts = facts
        self.ready = {(spec.name, str(v)) for spec in specs for v in spec.versions}
        self.facts_asked: list[tuple[str, str]] = []
        self.generated: list[dict[str, Any]] = []
        self.versions_asked: list[tuple[str, str]] = []
        """(model, version) of every generate call ("" : Triton's newest)."""
        self.tokens_per_row = 3
        self.inferred: list[dict[str, Any]] = []
        """(inputs, timeout_us) of every infer call."""

    async def repository_index(self) -> list[dict[str, Any]]:
        return [{"name": n, "version": v, "state": "READY"} for n, v in sorted(self.ready)]

    async def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return read_config(render_config(self.specs[name]))

    async def model_facts(self, name: str, version: str) -> contract.ModelFacts:
        self.facts_asked.append((name, version))
        return self.facts[(name, version)]

    async def generate(
        self, model, prompt, sampling_parameters, *, stream, logprobs=False, version="", images=None
    ):
        self.generated.append(dict(sampling_parameters))
        self.versions_asked.append((model, version))
        yield LLMResponse(["So"], ["length"], [1], 7, [None], final=True)

    async def infer(self, model, inputs, outputs, version="", timeout_us=None):
        self.inferred.append({"inputs": dict(inputs), "timeout_us": timeout_us})
        rows = len(next(iter(inputs.values())))
        values = {
            contract.EMBEDDING: np.ones((rows, 4), dtype=np.float32),
            contract.SCORE: np.full((rows, 1), 0.5, dtype=np.float32),
            contract.NUM_INPUT_TOKENS: np.full((rows, 1), self.tokens_per_row, dtype=np.uint32),
        }
        return {name: values[name] for name in outputs}

    async def is_ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def fake_app(repository: Path, fake: FakeTriton, **settings: Any) -> TestClient:
    """The frontend app on `repository`, its Triton calls answered by `fake` (`settings`: more
    FrontendConfig fields)."""
    config = FrontendConfig(triton_url="127.0.0.1:1", model_repository=repository, **settings)
    app = create_app(config)
    app.state.frontend.triton = app.state.frontend.registry.triton = fake
    return TestClient(app, raise_server_exceptions=False)


def llm_spec(name: str = "llm", versions: tuple[int, ...] = (1,), **parameters: str) -> ModelSpec:
    return ModelSpec(
        name,
        "llm",
        {"model": str(SHAKESPEARE), **parameters},
        versions=versions,
        max_batch_size=0,
        version_policy="all: {}",
    )
