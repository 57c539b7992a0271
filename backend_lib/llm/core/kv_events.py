"""KV cache events in vLLM's wire format, for cache-aware routing (llm-d's precise prefix-cache
scorer, Dynamo's KV router): what the prefix cache gained and lost, step by step.

A batch is a msgpack array `[ts, [event, ...]]`; each event an array whose first element names its
kind (msgspec's array-like tagged structs, as `vllm.distributed.kv_events`):

- `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`:
  full blocks registered in the prefix cache, in chain order; `parent_block_hash` is the hash the
  first one chains from (None for a prompt's first block); `token_ids` are all their tokens;
  `lora_id` the adapter whose hash namespace they are in (None: the base model);
- `["BlockRemoved", block_hashes, medium]`: blocks evicted from it;
- `["AllBlocksCleared"]`: everything before is void (sent when the engine starts).

Hashes are the pool's own: 32-byte chained SHA-256 digests (the publisher sends them as vLLM does
by default, the low 64 bits as an integer, unless configured otherwise). `medium` names the pool
("GPU" for the device pool on CUDA, "CPU" when the engine runs on the CPU). docs/deployment.md has
the schema; the publisher (serving/kv_event_publisher.py) adds vLLM's framing and replay.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from backend_lib.llm.core.block_pool import BlockHash


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    """Seconds since the epoch when the batch was taken."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The events of one block pool since the last `take`; consecutive stores of one chain (one
    sequence's blocks in one step) merge into one BlockStored, as vLLM sends them."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size, self.medium = block_size, medium
        self._events: list[KVCacheEvent] = [AllBlocksCleared()]

    def stored(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        lora_id: int | None,
    ) -> None:
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and parent_hash is not None
            and last.block_hashes[-1] == parent_hash
            and last.lora_id == lora_id
        ):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self._events.append(
            BlockStored(
                [block_hash], parent_hash, list(token_ids), self.block_size, lora_id, self.medium
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], self.medium))

    def take(self) -> KVEventBatch | None:
        """The events since the last call as one batch (None: nothing happened)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events)
