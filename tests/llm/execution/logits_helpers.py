"""Every position's logits of a sequence through a ModelRunner's paged-KV forward: what the
quantization tests score (perplexity) and compare (greedy choices) on the Shakespeare checkpoint."""

from __future__ import annotations

import torch

from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import ScheduledSequence
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution.model_runner import ModelRunner
from tests.llm.config_helpers import BLOCK_SIZE


def all_logits(model_runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of every position, the whole sequence run as one prefill
    through the runner's paged-KV forward."""
    seq = Sequence(0, "all-logits", list(ids), len(ids), SamplingParams(temperature=0.0), 0.0)
    seq.block_table = list(range(-(-len(ids) // BLOCK_SIZE)))
    batch = model_runner.prepare_input([ScheduledSequence(seq, len(ids))])
    with torch.inference_mode():
        hidden = model_runner.model(
            batch.input_ids, batch.positions, batch.meta, model_runner.kv_pool.layer_caches
        )
        return model_runner.model.compute_logits(hidden)
