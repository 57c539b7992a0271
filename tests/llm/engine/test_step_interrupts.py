"""Steps that yield (`interruptible_steps`, engine/step_interrupts.py) on the real model: a request
reported by the driver as arrived during a step, and outranking the step's work, drops the step
at its first layer boundary; nothing of it is sampled, the step after it completes even if the
arrival is still pending, the arrival's prefill runs in the step after it is added, every greedy
output is still transformers' own and every block comes back. Under fcfs, or with
`interruptible_steps: false`, no step yields."""

from __future__ import annotations

import pytest

from backend_lib.llm.core.request import EngineRequest
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FLOOD = [random_prompt(20 + 3 * k, 300 + k) for k in range(4)]
URGENT = random_prompt(6, 399)


def flood_engine(**settings):
    """A 3-slot engine with a 16-token budget, running four 20-29 token prompts at `flood`."""
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(
        model_dir, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64, **settings
    )
    for k, prompt in enumerate(FLOOD):
        engine.add(EngineRequest(f"flood{k}", None, greedy(8), prompt, priority=0, tenant="batch"))
    return engine, hf


def progress(engine) -> dict[int, tuple[int, int]]:
    """seq_id -> (computed tokens, tokens) of every unfinished sequence."""
    seqs = [*engine.scheduler.running, *engine.scheduler.waiting, *engine.scheduler.swapped]
    return {s.seq_id: (s.num_computed_tokens, s.num_tokens) for s in seqs}


def finish(engine, outputs: dict) -> dict:
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs


@pytest.mark.parametrize(
    ("settings", "urgent"),
    [
        ({"scheduling_policy": "priority"}, {"priority": -1, "tenant": "batch"}),
        ({"fair_share": True}, {"tenant": "chat"}),
    ],
    ids=["priority", "fair_share"],
)
def test_an_outranking_arrival_drops_the_step_and_outputs_stay_transformers(settings, urgent):
    engine, hf = flood_engine(**settings)
    outputs = {o.request_id: o for _ in range(2) for o in engine.step() if o.finished}
    request = EngineRequest("urgent", None, greedy(5), URGENT, **urgent)
    arrived = [request]
    engine.interrupts.arrivals = lambda: arrived
    before = progress(engine)
    assert engine.step() == []  # dropped: nothing sampled, nothing advanced
    assert engine.interrupts.count == 1
    assert {k: v for k, v in progress(engine).items() if k in before} == before
    assert engine.stats().counters.steps_interrupted == 1
    engine.step()  # the step after a dropped one completes, the arrival still pending
    assert engine.interrupts.count == 1
    assert progress(engine) != before
    arrived.clear()
    engine.add(request)
    engine.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == "urgent"]
    assert seq.num_output_tokens == 1  # its whole prompt and first token in the next step
    finish(engine, outputs)
    assert outputs["urgent"].outputs[0].token_ids == hf_greedy(hf, URGENT, 5)
    for k, prompt in enumerate(FLOOD):
        assert outputs[f"flood{k}"].outputs[0].token_ids == hf_greedy(hf, prompt, 8), k
    assert_pool_released(engine)


@pytest.mark.parametrize(
    "settings",
    [{}, {"scheduling_policy": "priority", "interruptible_steps": False}],
    ids=["fcfs", "priority-off"],
)
def test_no_step_yields_under_fcfs_or_when_turned_off(settings):
    engine, _ = flood_engine(**settings)
    engine.step()
    engine.interrupts.arrivals = lambda: [
        EngineRequest("urgent", None, greedy(5), URGENT, priority=-1 if settings else 0)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.interrupts.count == 0
    assert_pool_released(engine)


def test_an_arrival_that_does_not_outrank_the_step_lets_it_complete():
    """Under priority, an arrival of the flood's own class waits for its turn."""
    engine, _ = flood_engine(scheduling_policy="priority")
    engine.step()
    engine.interrupts.arrivals = lambda: [
        EngineRequest("same", None, greedy(5), URGENT, priority=0)
    ]
    before = progress(engine)
    engine.step()
    assert engine.interrupts.count == 0 and progress(engine) != before
