"""Mixtures of experts through the whole engine: greedy tokens identical to transformers'
`generate` under preemption, chunked prefill and prefix-cache hits; LoRA adapters on the
attention projections matching PEFT, adapters on expert weights refused at load."""

from __future__ import annotations

import pytest

from backend_lib.llm.lora.adapter import LoRALoadError, load_adapter
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    output_ids,
    random_prompt,
)
from tests.llm.lora_helpers import make_lora_engine
from tooling.hf_reference import hf_greedy
from tooling.lora_adapters import build_lora_adapter

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_preemption_chunking_and_prefix_hits_keep_outputs_exact(arch):
    model_dir, hf = engine_checkpoint(arch)
    engine = make_engine(model_dir, num_blocks=10, max_model_len=40, max_num_batched_tokens=16)
    shared = random_prompt(17, 3)  # two full blocks of 8
    engine.generate([shared + random_prompt(2, 4)], greedy(3))
    hits_before = engine.stats().counters.prefix_cache_hits
    prompts = [shared + random_prompt(n, 10 + n) for n in (5, 1)]
    prompts += [random_prompt(n, 20 + n) for n in (22, 7)]
    assert output_ids(engine, prompts, greedy(8)) == [hf_greedy(hf, p, 8) for p in prompts]
    counters = engine.stats().counters
    assert counters.num_preemptions > 0
    assert counters.prefix_cache_hits > hits_before
    assert_pool_released(engine)


def test_lora_on_attention_matches_peft_and_expert_adapters_are_refused(tmp_path):
    model_dir, hf = engine_checkpoint("Qwen2MoeForCausalLM")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    peft = build_lora_adapter(
        hf, tmp_path / "attn", rank=4, alpha=8, seed=3, target_modules=attention
    )
    # PEFT on every projection: the dense layer's MLP and the shared expert's get adapters too.
    build_lora_adapter(hf, tmp_path / "all", rank=4, alpha=8, seed=4)
    engine = make_lora_engine(model_dir, {"attn": tmp_path / "attn", "all": tmp_path / "all"})
    prompts = [random_prompt(n, 40 + n) for n in (6, 13)]
    outs = engine.generate(prompts, greedy(6), lora_names=["attn", None])
    assert outs[0].outputs[0].token_ids == hf_greedy(peft, prompts[0], 6)
    assert outs[1].outputs[0].token_ids == hf_greedy(hf, prompts[1], 6)
    assert hf_greedy(peft, prompts[0], 6) != hf_greedy(hf, prompts[0], 6)  # the adapter matters
    with pytest.raises(LoRALoadError, match="attention projections only"):
        load_adapter("all", tmp_path / "all", engine.runner.lora_spec, 16)
    assert_pool_released(engine)
