"""Property test: random arrival, abort and length schedules on a small KV pool (so prefix-cache
hits, chunked prefill and preemption by recompute or swap all happen), checking after each
workload that every KV block is back (device and host) and that every request's greedy output
equals what `transformers` generates for its prompt alone (an aborted one: a prefix of it)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")
ARCH = "Qwen3ForCausalLM"
MAX_TOKENS = 8
MAX_MODEL_LEN = 48
SHARED_PREFIX = random_prompt(16, 999)  # two full blocks of 8


@functools.cache
def reference(prompt: tuple[int, ...]) -> list[int]:
    """HF greedy continuation; a shorter greedy run is a prefix of it."""
    _, hf = engine_checkpoint(ARCH)
    return hf_greedy(hf, list(prompt), MAX_TOKENS)


requests = st.lists(
    st.fixed_dictionaries(
        {
            "prompt_len": st.integers(1, 28),
            "shared_prefix": st.booleans(),
            "max_tokens": st.integers(1, MAX_TOKENS),
            "arrival_step": st.integers(0, 4),
            "abort_step": st.none() | st.integers(0, 14),
        }
    ),
    min_size=2,
    max_size=8,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    reqs=requests,
    num_blocks=st.sampled_from([6, 6, 7, 32]),
    budget=st.sampled_from([8, 16, 256]),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_random_workloads_keep_invariants_and_outputs(reqs, num_blocks, budget, mode):
    model_dir, _ = engine_checkpoint(ARCH)
    engine = make_engine(
        model_dir,
        num_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
        preemption_mode=mode,
        swap_space=0.001,
    )
    prompts = {
        f"r{i}": (SHARED_PREFIX if r["shared_prefix"] else []) + random_prompt(r["prompt_len"], i)
        for i, r in enumerate(reqs)
    }
    finals, added, step = {}, set(), 0
    last_event = max(max(r["arrival_step"], r["abort_step"] or 0) for r in reqs)
    while step <= last_event or engine.has_unfinished_requests():
        for i, r in enumerate(reqs):
            request_id = f"r{i}"
            if r["arrival_step"] == step:
                engine.add_request(
                    request_id, None, greedy(r["max_tokens"]), prompt_token_ids=prompts[request_id]
                )
                added.add(request_id)
            if r["abort_step"] == step and request_id in added:
                aborted = engine.abort_request(request_id)
                if aborted is not None:
                    finals[request_id] = aborted
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
        assert step < 1000, "the engine stopped making progress"

    assert_pool_released(engine)
    assert set(finals) == set(prompts)
    stats = engine.stats().counters
    event(f"preempted={stats.num_preemptions > 0}, prefix_hits={stats.prefix_cache_hits > 0}")
    for i, r in enumerate(reqs):
        (completion,) = finals[f"r{i}"].outputs
        prompt = prompts[f"r{i}"]
        room = MAX_MODEL_LEN - len(prompt)  # generation stops at max_model_len as well
        expected = reference(tuple(prompt))[: min(r["max_tokens"], room)]
        if completion.finish_reason == "abort":
            assert completion.token_ids == expected[: len(completion.token_ids)]
        else:
            assert (completion.token_ids, completion.finish_reason) == (expected, "length")
