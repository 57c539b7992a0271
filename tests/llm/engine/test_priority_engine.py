"""`scheduling_policy: priority` in the engine: a request's `priority` reaches the scheduler, is
refused when it is not an integer or when the engine runs fcfs (vLLM's rule), and changes only
the order: under mixed priorities, displacement and preemption, every greedy output is still
transformers' own."""

from __future__ import annotations

import pytest

from backend_lib.errors import InputError
from backend_lib.llm.core.request import EngineRequest
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
    run_in_two_waves,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize(
    ("policy", "priority", "message"),
    [
        ("priority", 1.5, "priority must be an integer"),
        ("priority", True, "priority must be an integer"),
        ("priority", "1", "priority must be an integer"),
        ("fcfs", 1, "priority scheduling is not enabled"),
        ("priority", 2**31, "priority must be in"),
        ("priority", -(10**400), "priority must be in"),
    ],
)
def test_a_bad_priority_is_an_input_error(policy, priority, message):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, scheduling_policy=policy)
    request = EngineRequest("r", None, greedy(2), random_prompt(4, 1), priority=priority)
    with pytest.raises(InputError, match=message):
        engine.add(request)
    assert not engine.has_unfinished_requests()


def test_fcfs_takes_priority_zero():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    engine.add(EngineRequest("r", None, greedy(2), random_prompt(4, 1), priority=0))
    (seq,) = engine.scheduler.waiting
    assert seq.priority == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_are_transformers_under_priorities_and_displacement(mode):
    """Three slots and a pool of 10 blocks (80 tokens) for nine requests of mixed priorities arriving in two
    waves: better ones displace and preempt worse ones, and every output is still `generate`'s."""
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(
        model_dir,
        scheduling_policy="priority",
        max_num_seqs=3,
        max_model_len=64,
        num_blocks=10,
        preemption_mode=mode,
        swap_space=0.01,
    )
    prompts = [random_prompt(6 + 3 * (k % 4), 100 + k) for k in range(9)]
    priorities = [4, 4, 4, 2, 0, 3, 0, -1, 1]
    requests = [
        EngineRequest(f"r{k}", None, greedy(14), prompt, priority=priority)
        for k, (prompt, priority) in enumerate(zip(prompts, priorities, strict=True))
    ]
    outputs = run_in_two_waves(engine, requests, first=5)
    assert engine.scheduler.num_preemptions > 0
    for k, prompt in enumerate(prompts):
        assert outputs[f"r{k}"].outputs[0].token_ids == hf_greedy(hf, prompt, 14), k
    assert_pool_released(engine)
