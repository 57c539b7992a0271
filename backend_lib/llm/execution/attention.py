"""Attention over the paged KV cache: batch metadata and kernel-backend selection.

A step's tokens are flattened into one batch of T rows. Sequence b owns rows
`query_start_loc[b]:query_start_loc[b+1]`; its context (cached prefix plus the new tokens)
is `seq_lens[b]` long and lives in the blocks `block_tables[b]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from backend_lib.llm.execution.kernel_backend import resolve_kernel_backend
from kernels import KernelOps, kernel_ops

KVCache = tuple[torch.Tensor, ...]
"""One layer's (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; an
8-bit cache's (k_cache, v_cache, k_scale, v_scale), scales [num_blocks, block_size, num_kv_heads]
float32 (kernels/kv_cache.py)."""


@dataclass
class AttentionMetadata:
    """Where each flattened token sits in its sequence and in the KV cache (tensors on device)."""

    query_start_loc: torch.Tensor
    """[B+1] int32: row offsets of each sequence's new tokens."""
    seq_lens: torch.Tensor
    """[B] int32: context length of each sequence, new tokens included."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32: physical blocks of each sequence (padding entries are 0)."""
    slot_mapping: torch.Tensor
    """[T] int64: cache slot (block_id * block_size + offset) each new token's K/V is written to."""
    max_query_len: int
    max_seq_len: int
    visible_until: torch.Tensor | None = None
    """[T] int32: the last key position each token sees (None: its own, plain causal); a token of
    an image attended both ways (Gemma 3) sees up to the image's last position."""
    plan: Any = None
    """The kernel backend's per-step plan (`KernelOps.plan_attention`), shared by all layers."""


def select_kernel_ops(setting: str, device: torch.device) -> KernelOps:
    """Kernel set for `LLMConfig.kernel_backend` on `device` (auto: Triton on CUDA, PyTorch on CPU)."""
    return kernel_ops(resolve_kernel_backend(setting, device))
