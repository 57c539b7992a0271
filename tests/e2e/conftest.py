"""Fixtures of the reliability suite: one tritonserver shared by test_reliability.py and test_soak.py, on
a temporary repository with the three models plus `llm_small` (the same checkpoint with a tiny KV pool,
few sequences and a short queue, for overload), under explicit model control (a model can be reloaded
without restarting the server) and with the test-only fault hook armed. (`--soak-seconds` is declared
in tests/conftest.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend_lib.llm.serving.service import FAULT_INJECTION_ENV
from tests.conftest import start_server, stop_server
from tooling.repository import DEFAULT_MODELS, REPO_ROOT, ModelSpec, write_model
from tooling.tritonserver import TritonServer

FAULT_MARKER = "<<inject-fault>>"
"""A prompt holding this fails inside the engine step on the reliability server."""
SMALL_LLM = {
    "max_num_seqs": "4",
    "num_blocks": "12",
    "max_queue_size": "8",
    "max_model_len": "128",
    "max_num_batched_tokens": "256",
}
"""llm_small: 12 blocks of 16 tokens hold fewer than 4 sequences of 128 tokens, so it preempts."""


def write_reliability_repository(repository: Path) -> None:
    for spec in DEFAULT_MODELS:
        if spec.kind != "llm":
            write_model(spec, repository)
            continue
        # The default repository names the checkpoint relative to its own directory.
        parameters = {**spec.parameters, "model": str(REPO_ROOT / "models" / "shakespeare-llama")}
        write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), repository)
        write_model(
            ModelSpec("llm_small", "llm", {**parameters, **SMALL_LLM}, max_batch_size=0), repository
        )


@pytest.fixture(scope="session")
def reliability_server(tmp_path_factory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("reliability-repo")
    write_reliability_repository(repository)
    # Triton 2.51 never finishes unloading an instance whose stub was killed (test_reliability
    # kills one), so shutdown waits out the exit timeout: keep it short.
    server = start_server(
        repository,
        ["--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=10"],
        env={FAULT_INJECTION_ENV: FAULT_MARKER},
    )
    yield server
    stop_server(server)
