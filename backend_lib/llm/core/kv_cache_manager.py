"""Per-sequence KV-block bookkeeping: allocation, prefix-cache lookup, fork with copy-on-write,
and swapping to a host pool.

The manager edits `seq.block_table` and, at admission, `seq.num_computed_tokens`; it never decides
which sequence runs (that is the scheduler's job). Block copies it requires are returned (swaps)
or queued for the scheduler to collect (`take_copies`), and the runner performs them before the
forward pass that depends on them.

A sequence's hash chain starts from its adapter's `cache_salt` (the base model's from nothing), so
blocks computed under one LoRA adapter are never reused by another or by the base model; and a
block overlapping an image's placeholder tokens hashes that image's digest (core/multimodal.py), so
blocks of different images are never reused for each other.

With an offload tier (core/kv_offload.py), cached blocks the pool evicts are kept there, and a
prefix lookup continues there after the pool's last hit: those blocks get fresh device blocks,
loaded before the step's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend_lib.llm.core.block_pool import BlockHash, BlockPool, hash_block
from backend_lib.llm.core.kv_events import KVEventLog
from backend_lib.llm.core.kv_offload import KVOffloader, OffloadMoves
from backend_lib.llm.core.multimodal import block_extra_key
from backend_lib.llm.core.sequence import Sequence


@dataclass
class CachedPrefix:
    """The longest run of a sequence's leading full blocks found in the prefix cache: first in
    the device pool, then in the offload tier."""

    block_ids: list[int] = field(default_factory=list)
    """The device pool's hits."""
    tier_hashes: list[BlockHash] = field(default_factory=list)
    """The tier's hits after them, loaded into fresh blocks at admission."""
    num_tokens: int = 0
    """Tokens of both."""
    num_tier_tokens: int = 0
    """Of those, the tier's."""


class KVCacheManager:
    """Owns the device block pool and the host (swap) pool on behalf of the scheduler."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        offload: KVOffloader | None = None,
    ) -> None:
        """`offload`: the prefix cache's offload tier (None: evicted blocks are dropped)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.prefix_cache_queries = 0
        """Tokens of admitted sequences looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Of those, tokens found cached."""
        # Per sequence: chained hashes of its leading full blocks of tokens (memoised, as tokens
        # never change once appended), and how many of its blocks were offered to the cache.
        self._block_hashes: dict[int, list[BlockHash]] = {}
        self._num_cached_blocks: dict[int, int] = {}
        self._host_tables: dict[int, list[int]] = {}
        self._copies: list[tuple[int, int]] = []
        self.events: KVEventLog | None = None
        """Set by `record_events`."""
        self.offload = offload
        self.pool.on_evict = self._evicted
        self._reads: dict[int, list[tuple[BlockHash, int]]] = {}
        """Per waiting sequence with disk reads: its prefix's RAM slots, pinned until admission."""

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    # --- admission -------------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """Longest cached prefix of `seq.token_ids`, in full blocks (allocates nothing).

        It never covers the last token: that one must be computed to get logits to sample from.
        A sequence asking for prompt logprobs gets none (as in vLLM): every prompt position must
        be computed for its logprobs.
        """
        prefix = CachedPrefix()
        if not self._reads_cache(seq):
            return prefix
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        for index, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(
                block_hash, _parent(seq, hashes, index), self._block_tokens(seq, index)
            )
            if block_id is None:
                break
            prefix.block_ids.append(block_id)
        if self.offload is not None:
            for block_hash in hashes[len(prefix.block_ids) :]:
                if not self.offload.holds(block_hash):
                    break
                prefix.tier_hashes.append(block_hash)
        prefix.num_tier_tokens = len(prefix.tier_hashes) * self.block_size
        prefix.num_tokens = len(prefix.block_ids) * self.block_size + prefix.num_tier_tokens
        return prefix

    def _reads_cache(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None

    def fits(self, prefix: CachedPrefix, num_new_tokens: int) -> bool:
        """Whether `admit` of a sequence with this cached prefix and `num_new_tokens` after it
        would find enough free blocks."""
        num_needed = self.num_blocks_for(prefix.num_tokens + num_new_tokens) - len(prefix.block_ids)
        # Hit blocks that sit in the free queue leave it when referenced: they are not available.
        num_revived = sum(1 for b in prefix.block_ids if self.pool.blocks[b].ref_count == 0)
        return num_needed + num_revived <= self.pool.num_free_blocks

    def admit(self, seq: Sequence, prefix: CachedPrefix, num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix plus blocks for `num_new_tokens` after it.

        Sets `seq.num_computed_tokens` to the cached length. Returns False, changing nothing, when
        the pool is short of blocks.
        """
        if not self.fits(prefix, num_new_tokens):
            return False
        num_needed = self.num_blocks_for(prefix.num_tokens + num_new_tokens) - len(prefix.block_ids)
        self.pool.touch(prefix.block_ids)
        tier_slots = [self.offload.claim(h) for h in prefix.tier_hashes] if self.offload else []
        fresh = self.pool.allocate(num_needed)
        seq.block_table = prefix.block_ids + fresh
        for slot, block_id in zip(tier_slots, fresh, strict=False):
            self.offload.queue_load(slot, block_id)
        if seq.seq_id in self._reads:
            self.offload.release(self._reads.pop(seq.seq_id))
        seq.num_computed_tokens = prefix.num_tokens
        self._num_cached_blocks[seq.seq_id] = len(prefix.block_ids)
        self.cache_full_blocks(seq)  # the tier's blocks join the pool's prefix cache
        if self._reads_cache(seq):
            pool_hits = prefix.num_tokens - prefix.num_tier_tokens
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += pool_hits
            if self.offload is not None:
                self.offload.external_queries += seq.num_tokens - pool_hits
                self.offload.external_hits += prefix.num_tier_tokens
        return True

    # --- running ---------------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Extend a running sequence's block table to cover `num_new_tokens` more positions.

        A block those positions write into that is shared with another sequence (after `fork`) is
        first copied to a private block (copy-on-write, queued for `take_copies`). Returns False,
        changing nothing, when the pool is short of blocks.
        """
        table = seq.block_table
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        last_written = min(self.num_blocks_for(end), len(table))
        shared = [
            i
            for i in range(start // self.block_size, last_written)
            if self.pool.blocks[table[i]].ref_count > 1
        ]
        num_grow = self.num_blocks_for(end) - len(table)
        if num_grow + len(shared) > self.pool.num_free_blocks:
            return False
        for index in shared:
            (private,) = self.pool.allocate(1)
            self._copies.append((table[index], private))
            self.pool.free([table[index]])
            table[index] = private
        table.extend(self.pool.allocate(num_grow))
        return True

    def free_uncomputed_slots(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens: those only rejected draft tokens
        wrote into (speculative decoding). Fresh blocks of this step, never hashed."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        extra = seq.block_table[keep:]
        if extra:
            self.pool.free(reversed(extra))
            del seq.block_table[keep:]

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) device block pairs queued since the last call."""
        copies, self._copies = self._copies, []
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._hashes(seq, num_full)
        for index in range(self._num_cached_blocks.get(seq.seq_id, 0), num_full):
            tokens = self._block_tokens(seq, index)
            parent = _parent(seq, hashes, index)
            stored = self.pool.cache_block(seq.block_table[index], hashes[index], parent, tokens)
            if stored and self.events is not None:
                # The chain's first block has no parent block (only the adapter's salt).
                parent_block = hashes[index - 1] if index else None
                self.events.stored(hashes[index], parent_block, tokens, seq.lora_int_id or None)
        self._num_cached_blocks[seq.seq_id] = num_full

    def record_events(self, events: KVEventLog) -> None:
        """From now on, log what the device pool's prefix cache gains and loses (KV events)."""
        self.events = events

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached block leaves the pool: an event, and a copy kept in the tier."""
        if self.events is not None:
            self.events.removed(block_hash)
        if self.offload is not None:
            self.offload.evicted(block_id, block_hash)

    def take_offload_moves(self) -> OffloadMoves:
        """The tier copies queued since the last call (none without a tier)."""
        return self.offload.take_moves() if self.offload is not None else OffloadMoves()

    def prefetch(self, seq: Sequence) -> bool:
        """Queue the disk reads (in `take_offload_moves`) that bring back the blocks of a waiting
        sequence's prefix found only on disk; whether there were any. Their RAM slots, and
        those of the prefix's blocks already in RAM, are kept for it until its admission."""
        if self.offload is None or not self.offload.disk_enabled or not self._reads_cache(seq):
            return False
        if seq.seq_id in self._reads:  # pinned for it already: release, then plan afresh
            self.offload.release(self._reads.pop(seq.seq_id))
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        reads, pins = self.offload.plan_prefetch(
            hashes, {h for h in hashes if self.pool.is_cached(h)}
        )
        if pins:
            self._reads[seq.seq_id] = pins
        return bool(reads)

    def is_loading(self, seq: Sequence) -> bool:
        """Whether blocks of the sequence's prefix are being read back from disk."""
        if self.offload is None or not self.offload.num_prefetching:
            return False
        return self.offload.is_prefetching(self._block_hashes.get(seq.seq_id, ()))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of the parent's blocks with the child (one more reference each)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        num_shared = parent.num_computed_tokens // self.block_size
        self._block_hashes[child.seq_id] = self._block_hashes.get(parent.seq_id, [])[:num_shared]
        self._num_cached_blocks[child.seq_id] = self._num_cached_blocks.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds, device and host. Full blocks stay cached."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        host_table = self._host_tables.pop(seq.seq_id, None)
        if host_table:
            self.host_pool.free(host_table)
        self._block_hashes.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        if seq.seq_id in self._reads:
            self.offload.release(self._reads.pop(seq.seq_id))

    # --- swapping --------------------------------------------------------------------------------

    def host_block_table(self, seq: Sequence) -> list[int]:
        """Host blocks holding a swapped sequence's K/V, in order (empty when not swapped)."""
        return list(self._host_tables.get(seq.seq_id, ()))

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host_pool.num_free_blocks

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the host pool; returns (device, host) copy pairs."""
        host_table = self.host_pool.allocate(len(seq.block_table))
        pairs = list(zip(seq.block_table, host_table, strict=True))
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        self._host_tables[seq.seq_id] = host_table
        return pairs

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped sequence back with room for `num_new_tokens` more positions.

        Returns (host, device) copy pairs, or None, changing nothing, when the pool is short.
        """
        host_table = self._host_tables[seq.seq_id]
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        if num_needed > self.pool.num_free_blocks:
            return None
        seq.block_table = self.pool.allocate(num_needed)
        pairs = list(zip(host_table, seq.block_table, strict=False))
        self.host_pool.free(host_table)
        del self._host_tables[seq.seq_id]
        # Offer its full blocks to the prefix cache again: their old copies may be evicted.
        self._num_cached_blocks[seq.seq_id] = 0
        self.cache_full_blocks(seq)
        return pairs

    def _block_tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the sequence's first `num_blocks` full blocks (computed once)."""
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        features = () if seq.request is None else seq.request.mm_features
        for index in range(len(hashes), num_blocks):
            start = index * self.block_size
            extra = block_extra_key(features, start, start + self.block_size) if features else b""
            tokens = self._block_tokens(seq, index)
            hashes.append(hash_block(_parent(seq, hashes, index), tokens, extra))
        return hashes[:num_blocks]


def _parent(seq: Sequence, hashes: list[BlockHash], index: int) -> BlockHash | None:
    """The hash block `index` chains from: the previous block's, or for the first block the
    sequence's adapter salt (None for the base model)."""
    if index:
        return hashes[index - 1]
    return None if seq.lora_request is None else seq.lora_request.cache_salt
