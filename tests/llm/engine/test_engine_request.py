"""The EngineRequest seam: one typed request from the input processor to the scheduler's
sequences (a parallel-sampling request's children included), refused when it is not one."""

from __future__ import annotations

import pytest

from backend_lib.errors import InputError
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_the_request_reaches_every_sequence_with_its_arrival_time():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    request = EngineRequest(
        "r", None, SamplingParams(n=2, max_tokens=4, seed=1), prompt_token_ids=random_prompt(6, 1)
    )
    engine.add(request)
    (waiting,) = engine.scheduler.waiting
    assert waiting.request.request_id == "r" and waiting.request.params is request.params
    assert waiting.request.arrival_time == waiting.arrival_time is not None
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        seen |= {id(seq.request) for seq in engine.scheduler.running}
    assert seen == {id(waiting.request)}  # the forked child carries the same request


def test_the_fields_are_the_ones_the_engine_uses():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    prompt = random_prompt(5, 2)
    engine.add(
        EngineRequest("ids", "ignored text", greedy(3), prompt_token_ids=prompt, arrival_time=12.5)
    )
    (seq,) = engine.scheduler.waiting
    assert seq.prompt_token_ids == prompt and seq.arrival_time == 12.5


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (("r", "ka", greedy(2)), "request must be an EngineRequest"),
        (EngineRequest("", "ka", greedy(2)), "request_id must be a non-empty string"),
        (EngineRequest("r", None, greedy(2)), "prompt must be a string"),
    ],
)
def test_a_malformed_request_is_an_input_error(request_, message):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    with pytest.raises(InputError, match=message):
        engine.add(request_)
    assert not engine.has_unfinished_requests()
