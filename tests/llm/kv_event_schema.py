"""An independent reader of KV event batches, written from vLLM's published schema
(`vllm.distributed.kv_events`: msgspec structs, array-like, tagged by class name), not from the
engine's code: what a router would run. `ReplicaView` rebuilds a pool's cached blocks from them."""

from __future__ import annotations

from typing import Any

import msgspec

Hash = bytes | int


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(Event):
    block_hashes: list[Hash]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


class ReplicaView:
    """The blocks one replica holds, as its events say."""

    def __init__(self) -> None:
        self.blocks: dict[Hash, dict[str, Any]] = {}

    def apply(self, payload: bytes) -> Batch:
        batch = DECODER.decode(payload)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                size = event.block_size
                assert len(event.token_ids) == size * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * size : (i + 1) * size]
                    self.blocks[block_hash] = {
                        "parent": parent,
                        "tokens": tokens,
                        "lora_id": event.lora_id,
                        "medium": event.medium,
                    }
                    parent = block_hash
            else:
                for block_hash in event.block_hashes:
                    assert block_hash in self.blocks, "removed a block never stored"
                    del self.blocks[block_hash]
        return batch
