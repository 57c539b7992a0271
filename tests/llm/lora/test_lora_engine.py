"""Multi-LoRA fidelity: greedy tokens and logprobs of base and adapter requests, served together
in mixed batches (prefix hits, chunked prefill, preemption in the mix), against `peft`'s PeftModel
(and the adapter merged into the weights) on Llama, Qwen2 and Mistral checkpoints."""

from __future__ import annotations

import pytest
import torch

from backend_lib.llm.core.sampling_params import SamplingParams
from tests.llm.engine_helpers import assert_pool_released, greedy, random_prompt
from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
from tooling.hf_reference import hf_greedy, hf_next_logits
from tooling.lora_adapters import merged_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

NUM_TOKENS = 8


def _record_steps(engine) -> list[set[int]]:
    """Distinct lora ids (0: base) of every executed step, appended as the engine runs."""
    steps: list[set[int]] = []
    execute = engine.runner.execute

    def recording(out, *args):
        steps.append({item.seq.lora_int_id for item in out.scheduled})
        return execute(out, *args)

    engine.runner.execute = recording
    return steps


def _workload() -> tuple[list[list[int]], list[str | None]]:
    """(prompts, adapter names). Adapter requests share a 17-token prefix with a base request
    and with each other."""
    shared = random_prompt(17, 100)
    names = [None, "r4", "r8-rslora", "r16", None, "r4", "r16", "r8-rslora"]
    prompts = [shared + random_prompt(3 + 2 * i, 200 + i) for i in range(len(names))]
    prompts[4] = random_prompt(23, 300)  # a long base prompt without the shared prefix
    return prompts, names


@pytest.mark.parametrize(
    "arch,mode",
    [
        ("LlamaForCausalLM", "recompute"),
        ("Qwen2ForCausalLM", "swap"),
        ("MistralForCausalLM", "recompute"),
    ],
)
def test_mixed_batch_matches_peft(arch, mode):
    model_dir, hf, adapters = lora_checkpoint(arch)
    engine = make_lora_engine(
        model_dir,
        {name: path for name, (path, _) in adapters.items()},
        num_blocks=16,
        max_model_len=64,
        max_num_batched_tokens=24,
        preemption_mode=mode,
        swap_space=0.001,
    )
    steps = _record_steps(engine)
    prompts, names = _workload()
    # A first wave caches the shared prefix under r4 only.
    engine.generate([prompts[1]], greedy(2), lora_names=["r4"])
    hits_before = engine.stats().counters.prefix_cache_hits
    outs = engine.generate(prompts, greedy(NUM_TOKENS, logprobs=0), lora_names=names)

    counters = engine.stats().counters
    assert counters.num_preemptions > 0
    assert counters.prefix_cache_hits > hits_before
    assert any(len(step) == 4 for step in steps), "base and 3 adapters never shared a step"
    assert max(len(p) for p in prompts) > 24  # chunked prefill: some prompt exceeds the budget
    references = {None: hf} | {name: peft for name, (_, peft) in adapters.items()}
    merged = {name: merged_model(peft) for name, (_, peft) in adapters.items()}
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(references[name], prompt, NUM_TOKENS), (name, prompt)
        if name is not None:
            assert got == hf_greedy(merged[name], prompt, NUM_TOKENS), name
        for i, entry in enumerate(out.outputs[0].logprobs):
            want = torch.log_softmax(hf_next_logits(references[name], prompt + got[:i]), -1)
            assert abs(entry[got[i]].logprob - want[got[i]].item()) < 1e-4
    assert_pool_released(engine)


def test_adapters_change_the_output():
    """Sanity of the reference: each adapter's greedy output differs from the base model's."""
    model_dir, hf, adapters = lora_checkpoint("LlamaForCausalLM")
    prompt = random_prompt(12, 5)
    base = hf_greedy(hf, prompt, NUM_TOKENS)
    for _, peft in adapters.values():
        assert hf_greedy(peft, prompt, NUM_TOKENS) != base


def test_parallel_sampling_children_keep_the_adapter():
    model_dir, _, adapters = lora_checkpoint("LlamaForCausalLM")
    engine = make_lora_engine(model_dir, {name: path for name, (path, _) in adapters.items()})
    prompt = random_prompt(10, 6)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
    (out,) = engine.generate([prompt], params, lora_names=["r16"])
    peft = adapters["r16"][1]
    for completion in out.outputs:  # every child's tokens scored under the adapter
        tokens = completion.token_ids
        for i, entry in enumerate(completion.logprobs):
            want = torch.log_softmax(hf_next_logits(peft, prompt + tokens[:i]), -1)
            assert abs(entry[tokens[i]].logprob - want[tokens[i]].item()) < 1e-4
    assert_pool_released(engine)
