"""The engine end to end with `kernel_backend=triton` (Triton's interpreter on CPU, compiled on CUDA):
the same greedy tokens as with the PyTorch kernels, over prefills, chunked prefills, prefix-cache hits
and decodes in one mixed batch."""

from __future__ import annotations

import torch

from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt


def test_triton_kernels_give_the_same_greedy_tokens_as_torch():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    shared = random_prompt(12, seed=1)
    prompts = [
        shared + random_prompt(5, seed=2),
        shared + random_prompt(9, seed=3),
        random_prompt(3, seed=4),
    ]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(model_dir, kernel_backend=backend, max_num_batched_tokens=16)
        # The second wave reuses the first wave's cached prefix blocks.
        first = engine.generate(prompts[:1], greedy(6))
        rest = engine.generate(prompts[1:], greedy(6))
        outputs[backend] = [o.outputs[0].token_ids for o in first + rest]
        assert engine.stats().counters.prefix_cache_hits > 0
    assert outputs["triton"] == outputs["torch"]
    assert all(len(tokens) == 6 for tokens in outputs["torch"])


def test_backend_setting_reaches_the_model():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, kernel_backend="triton")
    from kernels import kernel_ops

    assert engine.runner.ops == kernel_ops("triton")
    assert make_engine(model_dir, kernel_backend="auto").runner.ops == kernel_ops(
        "triton" if torch.cuda.is_available() else "torch"
    )


def test_triton_lora_kernels_give_peft_s_greedy_tokens_in_a_mixed_batch():
    from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
    from tooling.hf_reference import hf_greedy

    model_dir, hf, adapters = lora_checkpoint("LlamaForCausalLM")
    engine = make_lora_engine(
        model_dir, {n: p for n, (p, _) in adapters.items()}, kernel_backend="triton"
    )
    names = [None, "r4", "r8-rslora", "r16"]
    prompts = [random_prompt(6 + 3 * i, seed=40 + i) for i in range(len(names))]
    outs = engine.generate(prompts, greedy(4), lora_names=names)
    references = {None: hf} | {name: peft for name, (_, peft) in adapters.items()}
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(references[name], prompt, 4), name
