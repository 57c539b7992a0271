"""Steps that yield (`interruptible_steps`, engine/step_interrupts.py) on the real model: a request
reported by the driver as arrived during a step, and outranking the step's work, drops the step
at its first layer boundary; nothing of it is sampled, the step after it completes even if the
arrival is still pending, the arrival's prefill runs in the step after it is added, every greedy
output is still transformers' own and every block comes back. A step dropped after a layer
leaves seeded samples, prompt logprobs and a constrained request as they would have been, and
charges no tenant. Under fcfs, or with `interruptible_steps: false`, no step yields."""

from __future__ import annotations

import re

import pytest

from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tests.llm.structured.structured_helpers import REGEX, byte_level_checkpoint
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


class LateArrival:
    """Arrivals that report `request` from the `at`-th call of a step on (call 2: before the
    second layer, so the first has written K/V of its own into the step's positions)."""

    def __init__(self, request: EngineRequest, at: int = 2) -> None:
        self.request, self.at, self.calls = request, at, 0

    def __call__(self) -> list[EngineRequest]:
        self.calls += 1
        return [self.request] if self.calls >= self.at else []


def mixed_flood() -> list[EngineRequest]:
    """Seeded sampling with n = 2, prompt logprobs, a regex constraint and plain greedy, all at
    priority 1."""
    flood = [
        SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": REGEX}),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    return [
        EngineRequest(f"flood{k}", f"ROMEO: speak {k}, {'and ' * (3 + 2 * k)}then", p, priority=1)
        for k, p in enumerate(flood)
    ]


def run_mixed(interrupt: bool) -> tuple[dict, int, dict]:
    """The mixed flood, and an urgent request arriving during its third step (dropped at its
    second layer when `interrupt`); (outputs, dropped steps, tokens charged by the dropped step)."""
    model_dir, _ = byte_level_checkpoint("random-llama")
    engine = make_engine(
        model_dir,
        scheduling_policy="priority",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        interruptible_steps=interrupt,
    )
    for request in mixed_flood():
        engine.add(request)
    outputs = {o.request_id: o for _ in range(2) for o in engine.step() if o.finished}
    urgent = EngineRequest("urgent", "JULIET: quick", greedy(4), priority=0)
    engine.interrupts.arrivals = LateArrival(urgent)
    engine.stats()  # drains the tokens counted so far
    engine.step()
    charged = engine.stats().tokens_by_tenant
    engine.interrupts.arrivals = None
    engine.add(urgent)
    finish(engine, outputs)
    assert_pool_released(engine)
    return outputs, engine.interrupts.count, charged


def test_a_step_dropped_after_a_layer_leaves_every_kind_of_request_as_it_was():
    """Dropped after its first layer wrote K/V: seeded n = 2 samples, prompt logprobs, a regex
    constraint (its bitmask was being filled) and greedy tokens are those of the same run whose
    step completed, and the dropped step charged no tenant a token."""
    ours, dropped, charged = run_mixed(interrupt=True)
    reference, none, _ = run_mixed(interrupt=False)
    assert (dropped, none, charged) == (1, 0, {})
    assert set(ours) == set(reference)
    for request_id, output in ours.items():
        theirs = reference[request_id]
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in theirs.outputs]
        if output.prompt_logprobs is not None:
            assert output.prompt_logprobs == theirs.prompt_logprobs
    assert re.fullmatch(REGEX, ours["flood2"].outputs[0].text)
