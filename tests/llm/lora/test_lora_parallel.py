"""LoRA rows under tensor and pipeline parallelism (issue 26): the engine's process is rank 0 and
drives rank 1 as a worker process, which loads each adapter from the path rank 0 names into the
same slot. Under TP=2 each rank holds its share of every adapter module (B's rows of the
column-parallel projections, A's columns of the row-parallel ones, added before the all-reduce);
under PP=2 each stage adapts its own layers. Base and adapter rows mixed in one batch, with
chunked prefill, a prefix hit and a slot eviction, give peft's greedy tokens and logprobs."""

from __future__ import annotations

import os

import pytest
import torch

from tests.llm.engine_helpers import assert_pool_released, greedy, random_prompt
from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
from tests.llm.tensor_parallel_helpers import worker_pids
from tooling.hf_reference import hf_greedy, hf_next_logits

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NUM_TOKENS = 6


@pytest.mark.parametrize(
    "parallel",
    ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}),
    ids=("tp2", "pp2"),
)
def test_sharded_adapters_match_peft(parallel):
    model_dir, hf, adapters = lora_checkpoint("LlamaForCausalLM")
    engine = make_lora_engine(
        model_dir,
        {name: path for name, (path, _) in adapters.items()},
        max_loras=2,  # three adapters over two slots: an eviction and a reload on every rank
        max_num_batched_tokens=24,
        **parallel,
    )
    shared = random_prompt(17, 100)
    names = [None, "r4", "r8-rslora", None, "r16", "r4"]
    prompts = [shared + random_prompt(3 + 2 * i, 200 + i) for i in range(len(names))]
    try:
        engine.generate([prompts[1]], greedy(2), lora_names=["r4"])  # caches the prefix under r4
        outs = engine.generate(prompts, greedy(NUM_TOKENS, logprobs=0), lora_names=names)
        assert engine.stats().counters.prefix_cache_hits > 0
        assert engine.runner.lora_slots.num_loads >= 3
        references = {None: hf} | {name: peft for name, (_, peft) in adapters.items()}
        for prompt, name, out in zip(prompts, names, outs, strict=True):
            got = out.outputs[0].token_ids
            assert got == hf_greedy(references[name], prompt, NUM_TOKENS), (name, prompt)
            for i, entry in enumerate(out.outputs[0].logprobs):
                want = torch.log_softmax(hf_next_logits(references[name], prompt + got[:i]), -1)
                assert abs(entry[got[i]].logprob - want[got[i]].item()) < 1e-4, name
        assert_pool_released(engine)
    finally:
        engine.close()
    assert worker_pids(os.getpid()) == []
