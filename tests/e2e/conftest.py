"""Fixtures of the reliability suite: one tritonserver shared by test_reliability.py and test_soak.py, on
a temporary repository (reliability_repository.py: the three models plus the overload-prone
`llm_small`), under explicit model control (a model can be reloaded without restarting the server)
and with the test-only fault hook armed (`--soak-seconds` is declared in tests/conftest.py); and
`direct_engine`, the default llm model run in-process, for test_llm.py and
test_llm_structured_outputs.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backend_lib.llm.engine.fault_injection import FAULT_INJECTION_ENV
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.e2e.llm_helpers import default_llm_engine
from tests.e2e.reliability_repository import FAULT_MARKER, write_reliability_repository
from tests.server_helpers import start_server, stop_server
from tooling.tritonserver import TritonServer


@pytest.fixture(scope="session")
def reliability_server(tmp_path_factory) -> Iterator[TritonServer]:
    repository = tmp_path_factory.mktemp("reliability-repo")
    write_reliability_repository(repository)
    # Triton 2.51 never finishes unloading an instance whose stub was killed (test_reliability
    # kills one), so shutdown waits out the exit timeout: keep it short.
    server = start_server(
        repository,
        ["--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=3"],
        env={FAULT_INJECTION_ENV: FAULT_MARKER},
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def direct_engine() -> LLMEngine:
    """The default llm model's engine in-process, once per test module (test_llm.py,
    test_llm_structured_outputs.py): what the server's greedy outputs must equal."""
    return default_llm_engine()
