"""The KV pool: one preallocated tensor holding every layer's K and V blocks, its sizing, and
the block moves the scheduler asks for (swap out/in to a host pool, copy-on-write copies).

Layout: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. Block `b` of
every layer sits at index `b` of dim 2, so moving a set of blocks across all layers is one
index_select / index_copy_ on that dim.

An 8-bit cache (`kv_cache_dtype` int8 or fp8) adds a float32 scale pool
[num_layers, 2, num_blocks, block_size, num_kv_heads] (one scale per stored token and kv head,
kernels/kv_cache.py), moved with the values by the same index ops, and each layer's cache is then
(k_cache, v_cache, k_scale, v_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.config import ConfigError
from backend_lib.llm.execution.attention import KVCache
from kernels.kv_cache import QUANTIZED_KV_DTYPES, byte_view

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
    """The cache's dtype: the model's, or int8 / float8_e4m3fn (then with scales)."""

    @property
    def quantized(self) -> bool:
        """An 8-bit cache, with a float32 scale per stored token and kv head."""
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim * elem + (4 if self.quantized else 0)  # + its float32 scale
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""The 8-bit `kv_cache_dtype` settings and their storage dtypes."""


def resolve_kv_cache_dtype(
    setting: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The cache dtype of the `kv_cache_dtype` setting (auto: the model's); ConfigError naming it
    for an unknown value or fp8 on a GPU older than compute capability 8.9."""
    if setting == "auto":
        return model_dtype
    if setting not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", setting, "expected one of auto, int8, fp8")
    if (
        setting == "fp8"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ConfigError(
            "kv_cache_dtype", setting, "fp8 needs a GPU of compute capability 8.9 or newer"
        )
    return KV_CACHE_DTYPES[setting]


def blocks_in(num_bytes: float, *specs: KVCacheSpec) -> int:
    """How many whole blocks fit in `num_bytes` (0 when none), a block costing one block of each
    spec (pools of the same block count, as the target's and its draft model's)."""
    return max(0, int(num_bytes // sum(spec.bytes_per_block for spec in specs)))


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
        pin = device.type == "cuda" and num_host_blocks > 0
        self.host_cache = torch.zeros(spec.shape(num_host_blocks), dtype=spec.dtype, pin_memory=pin)
        self.layer_caches: list[KVCache] = [
            (self.device_cache[i, 0], self.device_cache[i, 1]) for i in range(spec.num_layers)
        ]
        # An 8-bit cache's scales (zeroed: unwritten slots read as 0), moved with the values.
        self.device_scales = self.host_scales = None
        if spec.quantized:
            scale_shape = spec.shape(num_blocks)[:-1]
            self.device_scales = torch.zeros(scale_shape, dtype=torch.float32, device=device)
            self.host_scales = torch.zeros(
                spec.shape(num_host_blocks)[:-1], dtype=torch.float32, pin_memory=pin
            )
            self.layer_caches = [
                (*cache, self.device_scales[i, 0], self.device_scales[i, 1])
                for i, cache in enumerate(self.layer_caches)
            ]

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, host) tensors a block move copies: the caches (as bytes for float8, which
        index_copy_ lacks) and, for an 8-bit cache, the scales."""
        pairs = [(byte_view(self.device_cache), byte_view(self.host_cache))]
        if self.device_scales is not None:
            pairs.append((self.device_scales, self.host_scales))
        return pairs

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block, host block)."""
        if not pairs:
            return
        src, dst = self._ids(pairs, self.device, torch.device("cpu"))
        for device_pool, host_pool in self._pairs():
            blocks = device_pool.index_select(_BLOCK_DIM, src)
            # Blocking copy: the device blocks may be reused by the very next forward.
            host_pool.index_copy_(_BLOCK_DIM, dst, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: pairs of (host block, device block)."""
        if not pairs:
            return
        src, dst = self._ids(pairs, torch.device("cpu"), self.device)
        for device_pool, host_pool in self._pairs():
            blocks = host_pool.index_select(_BLOCK_DIM, src)
            device_pool.index_copy_(_BLOCK_DIM, dst, blocks.to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy device blocks to other device blocks, all layers, K and V."""
        if not pairs:
            return
        src, dst = self._ids(pairs, self.device, self.device)
        for device_pool, _ in self._pairs():
            device_pool.index_copy_(_BLOCK_DIM, dst, device_pool.index_select(_BLOCK_DIM, src))

    @staticmethod
    def _ids(
        pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(pairs, dtype=torch.int64)
        return ids[:, 0].to(src_device), ids[:, 1].to(dst_device)
