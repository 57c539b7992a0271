"""The test-only fault hook of LLMService (BACKEND_LIB_FAULT_INJECTION): a request whose prompt holds
the marker fails inside the engine step with "injected fault"; requests running beside it finish with
their normal output and the KV pool is released. Without the variable nothing is injected. Failed and
refused requests move `llm_request_failures_total` by reason."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from backend_lib.errors import InputError
from backend_lib.llm.engine.fault_injection import FAULT_INJECTION_ENV
from backend_lib.llm.serving.metrics import EXTRA_LABELS, FAILURE_REASONS
from backend_lib.llm.serving.service import LLMService
from backend_lib.metrics import PrometheusMetrics, parse_prometheus_text
from tests.llm.engine_helpers import assert_pool_released, engine_checkpoint
from tests.llm.service_helpers import PROMPTS, expected_texts, inputs, service_from_context

pytestmark = pytest.mark.usefixtures("single_torch_thread")
MARKER = "kaboom"


def collect(service: LLMService, job) -> tuple[str, Exception | None]:
    """(streamed text, error) of a submitted job."""
    text = ""
    for result, _final in service.responses(job):
        if isinstance(result, Exception):
            return text, result
        text += b"".join(result["text_output"]).decode()
    return text, None


def test_marked_request_fails_alone_and_the_pool_is_released(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    monkeypatch.setenv(FAULT_INJECTION_ENV, MARKER)
    service = service_from_context(model_dir)
    try:
        assert service.faults.marker == MARKER and service.engine.fault_injector is service.faults
        # The faulty request is submitted between two good ones, so they share engine steps.
        jobs = [
            service.submit(inputs(PROMPTS[0])),
            service.submit(inputs(f"ka {MARKER} ro")),
            service.submit(inputs(PROMPTS[1])),
        ]
        results = [collect(service, job) for job in jobs]
        assert results[1][0] == "" and isinstance(results[1][1], RuntimeError)
        assert "injected fault" in str(results[1][1])
        assert [results[0], results[2]] == [(text, None) for text in expected_texts(model_dir)]
        assert_pool_released(service.engine)
    finally:
        service.shutdown()


def test_without_the_variable_nothing_is_injected(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    service = service_from_context(model_dir)
    try:
        assert service.faults is None and service.engine.fault_injector is None
        text, error = collect(service, service.submit(inputs(f"ka {MARKER} ro")))
        assert error is None and text
    finally:
        service.shutdown()


def test_refused_and_failed_requests_are_counted_by_reason(monkeypatch):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    monkeypatch.setenv(FAULT_INJECTION_ENV, MARKER)
    sink = PrometheusMetrics({"model": "llm", "version": "1"}, extra_labels=EXTRA_LABELS)
    service = service_from_context(model_dir, sink)

    def failures() -> dict[str, float]:
        scraped = parse_prometheus_text(generate_latest(sink.registry).decode())
        return {
            dict(labels)["reason"]: v
            for (name, labels), v in scraped.items()
            if name == "llm_request_failures_total"
        }

    try:
        assert failures() == dict.fromkeys(FAILURE_REASONS, 0)
        bad = {**inputs(PROMPTS[0]), "sampling_parameters": np.array([b"{not json"], dtype=object)}
        for _ in range(2):
            with pytest.raises(InputError):
                service.start(bad, lambda result, final: None, lambda: False)
        job = service.submit(inputs(f"ka {MARKER} ro"))
        assert isinstance(collect(service, job)[1], RuntimeError)
        assert collect(service, service.submit(inputs(PROMPTS[1])))[1] is None
        assert failures() == dict.fromkeys(FAILURE_REASONS, 0) | {"invalid_input": 2, "internal": 1}
    finally:
        service.shutdown()
