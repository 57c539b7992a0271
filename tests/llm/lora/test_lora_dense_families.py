"""LoRA on Gemma 2 (the Llama family's projection names) and Phi-3 (adapters on its fused
`qkv_proj` / `gate_up_proj`, adapted whole): base and adapter requests in one batch, greedy tokens
against `peft`'s PeftModel."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.llm.engine_helpers import assert_pool_released, engine_checkpoint, greedy, random_prompt
from tests.llm.lora_helpers import make_lora_engine
from tooling.hf_reference import hf_greedy
from tooling.lora_adapters import ALL_PROJECTIONS, build_lora_adapter

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TARGETS = {
    "Gemma2ForCausalLM": ALL_PROJECTIONS,
    "Phi3ForCausalLM": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}


@pytest.mark.parametrize("arch", list(TARGETS))
def test_adapter_and_base_rows_match_peft(arch):
    model_dir, hf = engine_checkpoint(arch)
    adapter_dir = Path(tempfile.mkdtemp(prefix=f"lora-{arch}-"))
    peft_model = build_lora_adapter(
        hf, adapter_dir, rank=4, alpha=8, seed=3, target_modules=TARGETS[arch]
    )
    engine = make_lora_engine(model_dir, {"a": adapter_dir})
    prompts = [random_prompt(n, 40 + n) for n in (11, 6, 14)]
    names = ["a", None, "a"]
    outs = engine.generate(prompts, greedy(6), lora_names=names)
    references = {None: hf, "a": peft_model}
    got = [out.outputs[0].token_ids for out in outs]
    assert got == [hf_greedy(references[n], p, 6) for p, n in zip(prompts, names, strict=True)]
    assert got[0] != hf_greedy(hf, prompts[0], 6)  # the adapter changes the output
    assert_pool_released(engine)
