"""How many KV blocks a runner allocates: `num_blocks` when set; on CUDA what
gpu_memory_utilization leaves after the weights and a profiled worst-case step; on CPU
cpu_kv_cache_gb. A draft model's pool has as many blocks as the target's, so a block costs both
specs. Every rank of a parallel group takes the smallest count (the scheduler's block ids index
every rank's cache)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.kv_pool import (
    GIB,
    KVCacheSpec,
    KVPool,
    blocks_in,
    check_fits_one_sequence,
    gpu_kv_cache_bytes,
)

PeakProfiler = Callable[[], int]
"""Runs a worst-case step on the device; its peak activation memory in bytes."""


def allocate_kv_pool(
    config: LLMConfig,
    device: torch.device,
    specs: list[KVCacheSpec],
    max_model_len: int,
    profile_peak: PeakProfiler,
) -> KVPool:
    """The target's pool (`specs[0]`; the others are what each block also costs: a draft's)."""
    if config.num_blocks > 0:
        num_blocks, key, value = config.num_blocks, "num_blocks", config.num_blocks
    elif device.type == "cuda":
        num_blocks = _gpu_num_blocks(config, device, specs, profile_peak)
        key, value = "gpu_memory_utilization", config.gpu_memory_utilization
    else:
        num_blocks = blocks_in(config.cpu_kv_cache_gb * GIB, *specs)
        key, value = "cpu_kv_cache_gb", config.cpu_kv_cache_gb
    if config.world_size > 1:
        num_blocks = _min_over_ranks(num_blocks, device)
    check_fits_one_sequence(num_blocks, max_model_len, config.block_size, key, value)
    num_host_blocks = (
        blocks_in(config.swap_space * GIB, specs[0]) if config.preemption_mode == "swap" else 0
    )
    return KVPool(specs[0], num_blocks, num_host_blocks, device)


def _gpu_num_blocks(
    config: LLMConfig, device: torch.device, specs: list[KVCacheSpec], profile_peak: PeakProfiler
) -> int:
    weights = torch.cuda.memory_allocated(device)
    activation_peak = profile_peak()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = gpu_kv_cache_bytes(
        total, config.gpu_memory_utilization, weights, activation_peak, non_torch
    )
    return blocks_in(budget, *specs)


def _min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value`, over the whole world: every tensor-parallel rank and
    pipeline stage."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def worst_case_step(
    config: LLMConfig, max_model_len: int
) -> tuple[np.ndarray, list[list[int]], list[int]]:
    """The step that peaks activation memory: max_num_batched_tokens of prefill in sequences of up
    to max_model_len, max_num_seqs logits rows. Its q_lens, block tables and sample rows."""
    budget, block_size = config.max_num_batched_tokens, config.block_size
    lengths = [max_model_len] * (budget // max_model_len)
    lengths += [budget % max_model_len] if budget % max_model_len else []
    q_lens = np.array(lengths, dtype=np.int64)
    blocks_per_seq = -(-q_lens // block_size)
    first = np.concatenate(([0], np.cumsum(blocks_per_seq)))
    tables = [list(range(first[i], first[i + 1])) for i in range(len(lengths))]
    num_rows = min(config.max_num_seqs, budget)
    ends = np.cumsum(q_lens) - 1
    return q_lens, tables, [int(ends[i % len(ends)]) for i in range(num_rows)]


def measure_peak(device: torch.device, run: Callable[[], object]) -> int:
    """Peak CUDA memory (bytes) that `run` allocates beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before
