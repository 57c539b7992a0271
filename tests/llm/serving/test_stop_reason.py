"""The llm's `stop_reason` output (contract.STOP_REASON): with `finish_reason`, once a choice
finished, the stop string that stopped it as JSON (vLLM's stop_reason), null otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend_lib import contract
from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.service_helpers import MAX_TOKENS, PROMPTS, expected_texts, service_from_context

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _request(params: dict, stream: bool) -> dict[str, np.ndarray]:
    return {
        "text_input": np.array([PROMPTS[0].encode()], dtype=object),
        "stream": np.array([stream]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
        "return_finish_reason": np.array([True]),
    }


def test_stop_reason_names_the_matched_stop_string():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    text = expected_texts(model_dir)[0]
    stop = text[len(text) // 2 :][:3]
    assert len(stop) == 3
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    service = service_from_context(model_dir)
    try:
        stopped = list(
            service.responses(service.submit(_request({**greedy, "stop": ["§§", stop]}, True)))
        )
        *partials, (final, done) = stopped
        assert done and [r for r, _ in partials if contract.STOP_REASON in r] == []
        assert final["finish_reason"].tolist() == [b"stop"]
        assert [json.loads(v) for v in final[contract.STOP_REASON]] == [stop]
        [(whole, _)] = service.responses(service.submit(_request(greedy, False)))
        assert whole["finish_reason"].tolist() == [b"length"]
        assert [json.loads(v) for v in whole[contract.STOP_REASON]] == [None]
        without = _request(greedy, False)
        del without["return_finish_reason"]
        [(bare, _)] = service.responses(service.submit(without))
        assert contract.STOP_REASON not in bare
    finally:
        service.shutdown()
