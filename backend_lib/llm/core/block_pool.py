"""The pool of fixed-size KV blocks: reference counts, an LRU free queue and the prefix-cache index.

Block ids 0..num_blocks-1 index the KV tensors the runner allocates; this module only hands the
ids out. A block with ref_count 0 is free. A free block may still hold the K/V of a full block
registered in the prefix cache ("cached"): it can be revived by a prefix hit until it is evicted,
which happens when the free queue hands it out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Chained SHA-256 of a full block: it identifies the block's tokens and every token before it,
    and `extra_key`, what else its positions hold (the images behind placeholder tokens:
    core/multimodal.py's `block_extra_key`).

    A cryptographic hash (not Python's `hash`) so that clients cannot craft colliding prompts to
    read each other's cached K/V; lookups additionally compare the block's own tokens.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_key)
    return digest.digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    """Set while the block is registered in the prefix cache."""
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Hands out block ids, counts references and indexes full blocks by their chained hash."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks (ref_count 0), front = next handed out. Uncached blocks go to the front (their
        # contents are worthless); cached ones to the back, so eviction is least-recently-freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        """Called with the id and hash of each block leaving the prefix cache, before the block
        is handed out again (KV events, the offload tier)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached or not: all can be handed out."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0)."""
        return 1.0 - len(self._free) / len(self.blocks) if self.blocks else 0.0

    def free_block_ids(self) -> list[int]:
        """Free blocks in hand-out order (front first)."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (evicting their cache entries), each with ref_count 1."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix hit or a fork), reviving free cached ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching 0 join the free queue in that order, so callers pass a sequence's blocks
        tail first: its tail (least likely to be shared) is then evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
    ) -> bool:
        """Register a full, computed block under its chained hash; whether it was registered.

        No-op when the block is already registered or another block holds the same hash (the same
        content computed twice concurrently): one copy in the index is enough.
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = (
            block_hash,
            parent_hash,
            tuple(token_ids),
        )
        self._cached[block_hash] = block_id
        return True

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of every block in the prefix cache."""
        return [(block_id, block_hash) for block_hash, block_id in self._cached.items()]

    def cached_hashes(self) -> set[BlockHash]:
        """The hashes of every block in the prefix cache."""
        return set(self._cached)

    def lookup(
        self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: Sequence[int]
    ) -> int | None:
        """The cached block with this hash, parent and tokens, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # The hash already identifies the content; comparing guards against a hash collision.
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block_id

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
