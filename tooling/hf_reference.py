"""Hugging Face `transformers` as the independent reference the engine is checked against
(tests compare token for token, benchmarks check outputs before timing)."""

from __future__ import annotations

import torch
import transformers


@torch.inference_mode()
def hf_next_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """HF's float32 logits [vocab] for the token after `token_ids` (full forward, no cache)."""
    return model(torch.tensor([token_ids], device=model.device)).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(
    model: transformers.PreTrainedModel, token_ids: list[int], num_tokens: int
) -> list[int]:
    """`generate`'s greedy continuation of `token_ids`, EOS disabled so it runs `num_tokens` steps."""
    out = model.generate(
        torch.tensor([token_ids], device=model.device),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()


@torch.inference_mode()
def hf_greedy_constrained(
    model: transformers.PreTrainedModel,
    token_ids: list[int],
    grammar: object,
    max_new_tokens: int,
    eos_token_id: int,
) -> list[int]:
    """`generate`'s greedy continuation under xgrammar's own Hugging Face logits processor for
    `grammar` (an xgrammar CompiledGrammar), stopping at EOS (included) or max_new_tokens."""
    import xgrammar.contrib.hf  # only the structured-output tests need it

    out = model.generate(
        torch.tensor([token_ids], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=[xgrammar.contrib.hf.LogitsProcessor(grammar)],
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(token_ids) :].tolist()
