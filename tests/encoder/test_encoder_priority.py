"""Priority and deadlines through the encoder services (embedding and rerank) on the real
all-MiniLM-L6-v2: the optional `priority` input puts a request ahead of a flood queued before it
(answered after one micro-batch), the vectors and scores are those computed alone, a Triton request
timeout that passes ends the request with deadline_exceeded, and a bad priority fails alone; the
priority lane answers a better request while a flood's micro-batch is still being computed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.contract import EMBEDDING, PRIORITY, SCORE, ErrorCode
from backend_lib.encoder.reranker import BiEncoderReranker
from backend_lib.encoder.service import NO_LANE, EmbeddingService, RerankService, priority_lane
from backend_lib.errors import InputError, error_code
from backend_lib.model_context import ModelContext
from tooling.checkpoints import MINILM_DIR
from tooling.repository import ModelSpec, read_config, render_config

FLOOD_TEXT = "a rather long sentence about nothing in particular, " * 20


def column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=object)


def flood_request(k: int) -> dict[str, np.ndarray]:
    return {"text_input": column(*[f"{k}-{i} {FLOOD_TEXT}" for i in range(32)])}


def submit(service, inputs, answers, name, **kwargs) -> None:
    service.submit(inputs, lambda result: answers.append((name, result)), **kwargs)


def test_a_better_priority_goes_ahead_of_a_queued_flood_with_the_vectors_it_has_alone(minilm):
    service = EmbeddingService(minilm)
    answers: list = []
    for k in range(4):
        submit(service, flood_request(k), answers, f"flood-{k}")
    urgent = {
        "text_input": column("Who goes there?", "Stand, and unfold"),
        PRIORITY: np.array([[-1]], dtype=np.int32),
    }
    submit(service, urgent, answers, "urgent")
    assert service.scheduler.step()  # one micro-batch: the urgent request's two texts first
    assert [name for name, _ in answers] == ["urgent"]
    service.scheduler.run_until_idle()
    assert [name for name, _ in answers][1:] == [f"flood-{k}" for k in range(4)]
    (alone,) = EmbeddingService(minilm).execute([{"text_input": urgent["text_input"]}])
    np.testing.assert_allclose(answers[0][1][EMBEDDING], alone[EMBEDDING], atol=1e-5)
    flood_alone = EmbeddingService(minilm).execute([flood_request(2)])[0][EMBEDDING]
    np.testing.assert_allclose(answers[3][1][EMBEDDING], flood_alone, atol=1e-5)


def test_rerank_honours_priority_too(minilm):
    service = RerankService(BiEncoderReranker(minilm))
    answers: list = []
    queries = column(*["question"] * 16)
    submit(service, {"query": queries, "document": column(*[FLOOD_TEXT] * 16)}, answers, "flood")
    pair = {
        "query": column("who"),
        "document": column("Bernardo"),
        PRIORITY: np.array([[-3]], dtype=np.int32),
    }
    submit(service, pair, answers, "urgent")
    service.scheduler.step()
    assert answers[0][0] == "urgent" and answers[0][1][SCORE].shape == (1, 1)
    service.scheduler.run_until_idle()
    assert [name for name, _ in answers] == ["urgent", "flood"]


def test_a_request_past_its_triton_timeout_ends_with_deadline_exceeded(minilm):
    service = EmbeddingService(minilm)
    answers: list = []
    submit(service, flood_request(0), answers, "flood")
    submit(service, {"text_input": column("late")}, answers, "late", timeout_us=1)
    service.scheduler.run_until_idle()
    late = dict(answers)["late"]
    assert error_code(late) is ErrorCode.DEADLINE_EXCEEDED
    assert isinstance(dict(answers)["flood"], dict)


@pytest.mark.parametrize(
    "value", [np.array([[1.5]], dtype=np.float32), np.array([[1], [2]], dtype=np.int32)]
)
def test_a_bad_priority_fails_that_request_alone(minilm, value):
    good = {"text_input": column("fine")}
    bad = {"text_input": column("x", "y"), PRIORITY: value}
    refused, served = EmbeddingService(minilm).execute([bad, good])
    assert isinstance(refused, InputError) and PRIORITY in str(refused)
    assert served[EMBEDDING].shape == (1, minilm.dim)


def _minilm_context(parameters: dict[str, str]) -> ModelContext:
    config = read_config(render_config(ModelSpec("embedding", "embedding", {})))
    parameters = {"model": str(MINILM_DIR), "dtype": "float32", **parameters}
    return ModelContext("embedding", "1", MINILM_DIR, torch.device("cpu"), parameters, config)


def test_the_priority_lane_comes_from_the_config_and_a_bad_budget_names_its_field():
    assert EmbeddingService.from_context(_minilm_context({}), None).lane.tokens == 512
    off = EmbeddingService.from_context(_minilm_context({"priority_lane_tokens": "0"}), None)
    assert off.lane == NO_LANE
    with pytest.raises(ConfigError) as info:
        EmbeddingService.from_context(_minilm_context({"priority_lane_tokens": "-1"}), None)
    assert info.value.key == "priority_lane_tokens"


def test_on_the_priority_lane_a_better_request_is_answered_while_the_flood_s_batch_runs(minilm):
    """The flood's micro-batches are held at a gate; a better request, computed on the lane
    meanwhile, is answered with the vectors it has alone before the flood's first one ends."""
    service = EmbeddingService(minilm, lane=priority_lane(512, minilm.encoder))
    gate, flood_running, compute = threading.Event(), threading.Event(), service._compute

    def gated(items):
        if len(items) > 2:  # the flood's micro-batches
            flood_running.set()
            assert gate.wait(30)
        return compute(items)

    service._compute = gated
    service.start()
    answers: list = []
    try:
        for k in range(2):
            submit(service, flood_request(k), answers, f"flood-{k}")
        assert flood_running.wait(30)
        urgent = {
            "text_input": column("Who goes there?", "Stand, and unfold"),
            PRIORITY: np.array([[-1]], dtype=np.int32),
        }
        done = threading.Event()
        service.submit(urgent, lambda result: (answers.append(("urgent", result)), done.set()))
        assert done.wait(30)
        assert [name for name, _ in answers] == ["urgent"]
        gate.set()
    finally:
        gate.set()
        service.shutdown()
    (alone,) = EmbeddingService(minilm).execute([{"text_input": urgent["text_input"]}])
    np.testing.assert_allclose(answers[0][1][EMBEDDING], alone[EMBEDDING], atol=1e-5)
    assert sorted(name for name, _ in answers) == ["flood-0", "flood-1", "urgent"]
