"""The KV pool: one preallocated tensor holding every layer's K and V blocks, its sizing, and
the block moves the scheduler asks for (swap out/in to a host pool, copy-on-write copies).

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. Block `b` of
every layer sits at index `b` of dim 2, so moving a set of blocks across all layers is one
index_select / index_copy_ on that dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.config import ConfigError
from backend_lib.llm.execution.attention import KVCache

GIB = 1 << 30
_BLOCK_DIM = 2


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the cache of one block across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def blocks_in(num_bytes: float, spec: KVCacheSpec) -> int:
    """How many whole blocks fit in `num_bytes` (0 when none)."""
    return max(0, int(num_bytes // spec.bytes_per_block))


def gpu_kv_cache_bytes(
    total: int, utilization: float, weights: int, activation_peak: int, non_torch: int
) -> int:
    """KV budget on a GPU: its share of total memory minus what the model needs besides the cache
    (weights, the activation peak of a full-budget step, memory outside PyTorch's allocator)."""
    return int(total * utilization) - weights - activation_peak - non_torch


def check_fits_one_sequence(
    num_blocks: int, max_model_len: int, block_size: int, key: str, value: object
) -> None:
    """A pool that cannot hold one sequence of max_model_len tokens makes the engine unusable."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ConfigError(
            key,
            value,
            f"the KV pool holds {num_blocks} blocks ({num_blocks * block_size} tokens) but "
            f"one sequence of max_model_len={max_model_len} needs {needed}: give the "
            "cache more memory or lower max_model_len",
        )


class KVPool:
    """Device KV pool plus an optional host pool for swapped-out blocks."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, num_host_blocks: int, device: torch.device
    ):
        self.spec = spec
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.device = device
        # Zeroed, not empty: attention kernels may multiply masked-out slots by 0, and garbage NaNs
        # there would poison the result.
        self.device_cache = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device)
        # Pinned host memory makes swap transfers DMA-able.
        self.host_cache = torch.zeros(
            spec.shape(num_host_blocks),
            dtype=spec.dtype,
            pin_memory=device.type == "cuda" and num_host_blocks > 0,
        )
        self.layer_caches: list[KVCache] = [
            (self.device_cache[i, 0], self.device_cache[i, 1]) for i in range(spec.num_layers)
        ]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block, host block)."""
        if not pairs:
            return
        src, dst = self._ids(pairs, self.device, torch.device("cpu"))
        blocks = self.device_cache.index_select(_BLOCK_DIM, src)
        # Blocking copy: the device blocks may be reused by the very next forward.
        self.host_cache.index_copy_(_BLOCK_DIM, dst, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: pairs of (host block, device block)."""
        if not pairs:
            return
        src, dst = self._ids(pairs, torch.device("cpu"), self.device)
        blocks = self.host_cache.index_select(_BLOCK_DIM, src)
        self.device_cache.index_copy_(_BLOCK_DIM, dst, blocks.to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy device blocks to other device blocks, all layers, K and V."""
        if not pairs:
            return
        src, dst = self._ids(pairs, self.device, self.device)
        self.device_cache.index_copy_(
            _BLOCK_DIM, dst, self.device_cache.index_select(_BLOCK_DIM, src)
        )

    @staticmethod
    def _ids(
        pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.int64)
        return ids[:, 0].to(src_device), ids[:, 1].to(dst_device)
