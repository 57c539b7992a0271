"""Held-out perplexity of the engine's model (the quality gates' harness): the validation passages
of tests/llm/execution/data/shakespeare_validation_sample.json, each run as one prefill through a
ModelRunner's paged-KV forward, every position scored."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from backend_lib.llm.execution.model_runner import ModelRunner
from tests.llm.config_helpers import llm_config
from tests.llm.execution.logits_helpers import all_logits
from tests.llm.shakespeare_helpers import SHAKESPEARE

SAMPLE = Path(__file__).parent / "data" / "shakespeare_validation_sample.json"


def passages() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHAKESPEARE, local_files_only=True)
    texts = json.loads(SAMPLE.read_text(encoding="utf-8"))["passages"].values()
    return [tokenizer(text).input_ids for text in texts]


def runner(model_dir: Path = SHAKESPEARE, **overrides) -> ModelRunner:
    config = llm_config(model_dir, num_blocks=64, max_model_len=512, **overrides)
    return ModelRunner(config, torch.device("cpu"), model_dir)


def summed_nll(model_runner: ModelRunner, ids: list[int]) -> tuple[float, int]:
    """(sum of -log p(token | prefix) over every token after the first, count)."""
    logits = all_logits(model_runner, ids)
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum")
    return nll.item(), len(ids) - 1


def engine_perplexity(model_runner: ModelRunner, sequences: list[list[int]]) -> float:
    total, count = 0.0, 0
    for ids in sequences:
        nll, n = summed_nll(model_runner, ids)
        total, count = total + nll, count + n
    return math.exp(total / count)
