"""The prefix cache's second tier as the scheduler sees it: which block hashes host memory (RAM)
and a disk directory hold, and the block copies that move them. Nothing here touches a tensor;
execution/kv_offload_store.py applies the copies.

The policy, in order:
1. Write-back on eviction. A full, hashed block that leaves the device pool (its id handed out
   again by `BlockPool.allocate`) is stored in a RAM slot, copied before the forward that
   overwrites it. The least recently used RAM entry makes room; a slot loaded from this step is
   never the one reused. With a disk tier, the stored block is also written to its file on a
   writer thread (write-through from RAM), and counts as on disk once the write is confirmed.
2. Lookup. A prefix lookup that runs out of device hits continues in RAM: each hit gets a fresh
   device block, loaded from its slot before the step's forward, and is registered in the device
   pool's prefix cache like any computed block.
3. Disk. When a sequence is queued, the blocks of its prefix found only on disk are read back
   into RAM slots on a reader thread (prefetch). The sequence waits at the head of the queue,
   holding no batch slot or device block, until they are in (or failed, then recomputed).
4. Faults. A file that fails its length or checksum check, or is missing, is a miss: dropped,
   never served. A failed write turns the disk tier off for the life of the engine (the store
   logs it and counts it); RAM goes on.

Hashes are the device pool's (core/block_pool.py): a LoRA adapter's and a `cache_salt`'s chains
start from their salt, so they keep their own namespace in the tier too.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from backend_lib.llm.core.block_pool import BlockHash


@dataclass
class OffloadMoves:
    """A step's tier copies, applied before its forward in this order: store, write, load; the
    disk reads are started then and run beside the step."""

    store: list[tuple[int, int]] = field(default_factory=list)
    """(device block, RAM slot): an evicted block's K/V kept in RAM."""
    write: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(RAM slot, block hash): a stored block also written to its disk file (after `store`)."""
    load: list[tuple[int, int]] = field(default_factory=list)
    """(RAM slot, device block): a tier hit copied back into the device pool."""
    read: list[tuple[BlockHash, int]] = field(default_factory=list)
    """(block hash, RAM slot): a disk block read back into RAM for a waiting sequence."""
    flush: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(device block, block hash): written straight to disk (at shutdown, the pool's blocks)."""

    def __bool__(self) -> bool:
        return bool(self.store or self.write or self.load or self.read or self.flush)


@dataclass
class TierReport:
    """What the store's threads finished since the previous report (execution side to core)."""

    written: list[BlockHash] = field(default_factory=list)
    """Blocks whose disk file is complete."""
    removed: list[BlockHash] = field(default_factory=list)
    """Blocks whose file is gone: evicted to stay within the disk size, or dropped as corrupt."""
    prefetched: list[tuple[BlockHash, int, bool]] = field(default_factory=list)
    """(hash, RAM slot, whether it was read back intact)."""
    disk_failed: bool = False
    """A write failed (disk full, path gone or read-only): the disk tier is off from now on."""


@dataclass
class TierCounters:
    """Cumulative per-tier counts, in blocks."""

    hits: int = 0
    """Blocks found here and loaded (RAM) or read back (disk)."""
    stores: int = 0
    """Blocks written here."""
    evictions: int = 0
    """Blocks dropped to make room."""
    errors: int = 0
    """Failed writes, and reads that were corrupt, truncated or missing."""


class HostTier:
    """The RAM tier's index: block hash -> slot, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: Counter[int] = Counter()
        """Slots that no reservation may reuse: loads of this step, reads for a waiting sequence."""
        self.counters = TierCounters()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding this block (now the most recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for a new block (the least recently used unpinned one when none is free), now
        holding `block_hash`; None when every slot is pinned."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.counters.evictions += 1
        self._slots[block_hash] = slot
        return slot

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a block (its slot's contents are not what the hash says)."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            del self._pinned[slot]
            self._free.append(slot)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The block's slot, leaving the LRU order as it is."""
        return self._slots.get(block_hash)

    def pin(self, slot: int) -> None:
        self._pinned[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if self._pinned[slot] > 1:
                self._pinned[slot] -= 1
            else:
                del self._pinned[slot]

    def drop_slots(self, slots: set[int]) -> None:
        """Forget the blocks in these slots."""
        for block_hash in [h for h, s in self._slots.items() if s in slots]:
            self.drop(block_hash)


class KVOffloader:
    """The tiers' indexes and the copies each step needs (see the module docstring)."""

    def __init__(
        self, num_slots: int, block_size: int, disk: bool = False, on_disk: Iterable = ()
    ) -> None:
        """`num_slots`: RAM slots (blocks); `disk`: whether a disk tier is on; `on_disk`: the
        hashes its directory already holds (a restart that reuses it)."""
        self.block_size = block_size
        self.ram = HostTier(num_slots)
        self.disk_enabled = disk
        self._on_disk: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(on_disk)
        self.disk = TierCounters()
        self._writing: set[BlockHash] = set()
        self._prefetching: dict[BlockHash, int] = {}
        self._moves = OffloadMoves()
        self.external_queries = 0
        """Tokens looked up in the tier (those the device pool missed), vLLM's external queries."""
        self.external_hits = 0
        """Of those, tokens loaded from the tier."""

    @property
    def num_disk_blocks(self) -> int:
        return len(self._on_disk)

    # --- the device pool's side ------------------------------------------------------------------

    def evicted(self, device_block: int, block_hash: BlockHash) -> None:
        """A cached block leaves the device pool: keep it in RAM (and on disk)."""
        if block_hash in self.ram or block_hash in self._prefetching:
            self.ram.lookup(block_hash)  # already kept: the copies are identical
            return
        slot = self.ram.reserve(block_hash)
        if slot is None:
            return
        # Pinned until the step's copies are taken: a second store of this step reusing the slot
        # would overwrite it before its disk write's snapshot.
        self.ram.pin(slot)
        self._moves.store.append((device_block, slot))
        self.ram.counters.stores += 1
        if (
            self.disk_enabled
            and block_hash not in self._on_disk
            and block_hash not in self._writing
        ):
            self._moves.write.append((slot, block_hash))
            self._writing.add(block_hash)

    def claim(self, block_hash: BlockHash) -> int:
        """The RAM slot of a hit found by `holds`, pinned for this step: no store of the step may
        reuse it before its load runs."""
        slot = self.ram.lookup(block_hash)
        assert slot is not None, "claim a block that holds() found"
        self.ram.pin(slot)
        return slot

    def queue_load(self, slot: int, device_block: int) -> None:
        """Copy a claimed slot into `device_block` before the step's forward."""
        self._moves.load.append((slot, device_block))
        self.ram.counters.hits += 1

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether RAM holds the block, read back (a load would find it)."""
        return block_hash in self.ram and block_hash not in self._prefetching

    def take_moves(self) -> OffloadMoves:
        """The copies queued since the last call, for the runner to apply before the forward."""
        moves, self._moves = self._moves, OffloadMoves()
        self.ram.unpin(slot for slot, _ in moves.load)
        self.ram.unpin(slot for _, slot in moves.store)
        return moves

    def forget(self, moves: OffloadMoves) -> None:
        """The step carrying `moves` failed, maybe before its copies ran: its stored slots may
        hold nothing. Its disk reads were started first thing (the runner's), and are reported."""
        self.ram.drop_slots({slot for _, slot in moves.store})
        for _, block_hash in moves.write:
            self._writing.discard(block_hash)

    def unwritten(self, cached: Iterable[tuple[int, BlockHash]]) -> list[tuple[int, BlockHash]]:
        """Of the device pool's cached blocks (id, hash), those the disk tier lacks, now counted
        as being written: what a shutdown writes so that a restart finds them (empty without a
        disk tier)."""
        if not self.disk_enabled:
            return []
        missing = [
            (block_id, block_hash)
            for block_id, block_hash in cached
            if block_hash not in self._on_disk and block_hash not in self._writing
        ]
        self._writing.update(block_hash for _, block_hash in missing)
        return missing

    # --- disk ------------------------------------------------------------------------------------

    def plan_prefetch(
        self, hashes: Iterable[BlockHash], held: set[BlockHash]
    ) -> tuple[list[tuple[BlockHash, int]], list[tuple[BlockHash, int]]]:
        """Disk reads for the leading blocks of a chain that only the disk holds: (reads, pins).

        `hashes` is a sequence's chain of full-block hashes; `held` those the device pool has.
        Walks the chain while a block is somewhere; stops at the first it cannot find (the rest
        would be recomputed anyway). `reads`: (hash, RAM slot) to read into. `pins`: every RAM
        slot of the chain (read or already there), pinned for the sequence until `release`, so
        that neither these reads nor other traffic evict them before it is admitted."""
        reads, pins = [], []
        for block_hash in hashes:
            if block_hash in held:
                continue
            slot = self.ram.slot_of(block_hash)
            if slot is None:
                if not self.disk_enabled or block_hash not in self._on_disk:
                    break
                slot = self.ram.reserve(block_hash)
                if slot is None:
                    break
                self._prefetching[block_hash] = slot
                reads.append((block_hash, slot))
                self._moves.read.append((block_hash, slot))
            self.ram.pin(slot)
            pins.append((block_hash, slot))
        if not reads:  # nothing to wait for: the RAM hits are found at admission as they are
            self.release(pins)
            return [], []
        return reads, pins

    def release(self, reads: Iterable[tuple[BlockHash, int]]) -> None:
        """The sequence that `plan_prefetch` read these for was admitted or ended: its slots are
        ordinary LRU entries again."""
        self.ram.unpin(slot for block_hash, slot in reads if self.ram.slot_of(block_hash) == slot)

    def is_prefetching(self, hashes: Iterable[BlockHash]) -> bool:
        return any(block_hash in self._prefetching for block_hash in hashes)

    @property
    def num_prefetching(self) -> int:
        return len(self._prefetching)

    def absorb(self, report: TierReport) -> None:
        """Apply what the store's threads finished."""
        for block_hash in report.written:
            self._writing.discard(block_hash)
            if self.disk_enabled:
                self._on_disk[block_hash] = None
                self.disk.stores += 1
        for block_hash in report.removed:
            if block_hash in self._on_disk:
                del self._on_disk[block_hash]
                self.disk.evictions += 1
        for block_hash, _slot, ok in report.prefetched:
            self._prefetching.pop(block_hash, None)
            if ok:
                self.disk.hits += 1
                self._on_disk.move_to_end(block_hash, last=True)
            else:
                self.disk.errors += 1
                self.ram.drop(block_hash)
                self._on_disk.pop(block_hash, None)
        if report.disk_failed and self.disk_enabled:
            self.disk_enabled = False
            self.disk.errors += 1
            self._on_disk.clear()
            self._writing.clear()
