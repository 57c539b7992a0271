"""What the engine-level speculative decoding tests share: the two methods' configs on the
Shakespeare model, prompts whose answers quote them, and an engine builder."""

from __future__ import annotations

import json

import torch

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.shakespeare_helpers import HELD_OUT, SHAKESPEARE, SHAKESPEARE_DRAFT, SONNETS_ADAPTER

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": str(SHAKESPEARE_DRAFT), "num_speculative_tokens": 4}
METHODS = {"ngram": NGRAM, "draft_model": DRAFT}
ROMEO = HELD_OUT["Romeo and Juliet, V.3"]
SONNET = HELD_OUT["Sonnet 154"]
SMALL_POOL = {"block_size": 8, "num_blocks": 40, "max_model_len": 320}
"""A KV pool the four prompts and their answers overflow: sequences are preempted."""
PROMPTS = [
    SONNET + "\n" + SONNET[:60],  # a passage, then its start again: answers quote it
    ROMEO[:400] + "\n\n" + ROMEO[:50],
    "ROMEO:\nWhat light",
    "CAPULET:\nO brother Montague, give me thy hand:\n",
]


def engine(speculative: dict | None = None, lora: bool = False, **overrides) -> LLMEngine:
    settings = dict(
        model=str(SHAKESPEARE),
        dtype="float32",
        kernel_backend="torch",
        num_blocks=160,
        max_model_len=512,
        speculative_config="" if speculative is None else json.dumps(speculative),
    )
    if lora:
        settings.update(enable_lora=True, max_lora_rank=16)
    config = LLMConfig(**{**settings, **overrides})
    config.validate()
    modules = {"sonnets": SONNETS_ADAPTER} if lora else None
    return LLMEngine(config, SHAKESPEARE, torch.device("cpu"), lora_modules=modules)


def completions(outputs) -> list[list[tuple[str, list[int], str | None]]]:
    return [[(c.text, c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]
