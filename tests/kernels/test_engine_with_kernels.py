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
