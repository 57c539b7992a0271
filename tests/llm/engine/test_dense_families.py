"""Gemma and Phi-3 through the whole engine against `transformers`' greedy generate: a pool small
enough to preempt, prompts sharing blocks so later ones hit the prefix cache, chunked prefill,
and sequences longer than Gemma's sliding window."""

from __future__ import annotations

import pytest

from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    output_ids,
    random_prompt,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Phi3ForCausalLM"])
def test_preemption_and_prefix_hits_match_generate(arch):
    model_dir, hf = engine_checkpoint(arch)
    engine = make_engine(model_dir, num_blocks=10, max_model_len=40, max_num_batched_tokens=16)
    shared = random_prompt(17, 1)  # two full blocks of 8, then one token
    warm = [shared + random_prompt(3, 2)]
    prompts = [shared + random_prompt(n, 3 + n) for n in (4, 1)] + [
        random_prompt(n, 10 + n) for n in (19, 9, 13)
    ]
    assert output_ids(engine, warm, greedy(4)) == [hf_greedy(hf, warm[0], 4)]
    counters = engine.stats().counters
    hits, preemptions = counters.prefix_cache_hits, counters.num_preemptions
    assert output_ids(engine, prompts, greedy(10)) == [hf_greedy(hf, p, 10) for p in prompts]
    counters = engine.stats().counters
    assert counters.prefix_cache_hits > hits
    assert counters.num_preemptions > preemptions
    assert_pool_released(engine)
