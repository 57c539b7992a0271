"""The offload tier's bookkeeping (core/kv_offload.py) through the KV cache manager: evicted
blocks are stored once and found again after the pool's hits, a slot loaded in a step is never
reused by that step's stores, disk blocks are read for a waiting sequence and kept for it, and a
failed step, a failed read or a failed write leaves nothing that could be served wrong."""

from __future__ import annotations

from backend_lib.llm.core.block_pool import hash_block
from backend_lib.llm.core.kv_cache_manager import KVCacheManager
from backend_lib.llm.core.kv_offload import KVOffloader, TierReport
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.sequence import Sequence

BS = 4


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), SamplingParams(), 0.0)


def chain(tokens: list[int]) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hash_block(parent, tokens[start : start + BS])
        hashes.append(parent)
    return hashes


def computed(kv: KVCacheManager, s: Sequence) -> None:
    """Admit `s` with nothing cached, compute its prompt, cache its blocks, free it."""
    prefix = kv.find_cached_prefix(s)
    assert kv.admit(s, prefix, s.num_tokens - prefix.num_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)
    kv.free(s)


def test_evicted_blocks_are_stored_once_and_found_after_the_pool_hits():
    offload = KVOffloader(num_slots=8, block_size=BS)
    kv = KVCacheManager(4, BS, offload=offload)
    a = list(range(100, 113))  # 3 full blocks and one token
    computed(kv, seq(0, a))
    moves = kv.take_offload_moves()
    assert not moves  # nothing evicted yet
    computed(kv, seq(1, list(range(200, 213))))  # takes every block: a's three are evicted
    stored = kv.take_offload_moves()
    assert len(stored.store) == 3 and not stored.load

    again = seq(2, a + [7])
    prefix = kv.find_cached_prefix(again)
    assert prefix.block_ids == [] and prefix.tier_hashes == chain(a)
    assert prefix.num_tokens == prefix.num_tier_tokens == 12
    assert kv.admit(again, prefix, again.num_tokens - 12)
    moves = kv.take_offload_moves()
    assert sorted(slot for slot, _ in moves.load) == sorted(slot for _, slot in stored.store)
    assert [device for _, device in moves.load] == again.block_table[:3]
    assert kv.pool.is_cached(chain(a)[0])  # back in the pool's prefix cache
    assert offload.external_hits == 12 and kv.prefix_cache_hits == 0


def test_a_slot_loaded_in_a_step_is_not_reused_by_its_stores():
    offload = KVOffloader(num_slots=2, block_size=BS)
    kv = KVCacheManager(3, BS, offload=offload)
    a = list(range(100, 109))  # 2 full blocks
    computed(kv, seq(0, a))
    computed(kv, seq(1, list(range(200, 209))))  # evicts a's 2 blocks into both slots
    kv.take_offload_moves()
    computed(kv, seq(3, list(range(300, 302))))
    kv.take_offload_moves()
    again = seq(2, a)
    prefix = kv.find_cached_prefix(again)
    assert len(prefix.tier_hashes) == 2
    # Admission allocates blocks whose eviction wants RAM slots: both are pinned by the loads.
    assert kv.admit(again, prefix, 1)
    moves = kv.take_offload_moves()
    assert {slot for slot, _ in moves.load} == {0, 1}
    assert not {slot for _, slot in moves.store} & {0, 1}


def test_a_failed_step_forgets_its_stored_slots():
    offload = KVOffloader(num_slots=4, block_size=BS)
    kv = KVCacheManager(3, BS, offload=offload)
    a = list(range(100, 105))
    computed(kv, seq(0, a))
    computed(kv, seq(1, list(range(200, 209))))
    moves = kv.take_offload_moves()
    assert moves.store
    offload.forget(moves)  # the copies never ran
    assert not offload.holds(chain(a)[0])


def test_disk_blocks_are_read_for_a_waiting_sequence_and_kept_for_it():
    a = list(range(100, 113))
    on_disk = chain(a)
    offload = KVOffloader(num_slots=3, block_size=BS, disk=True, on_disk=on_disk)
    kv = KVCacheManager(8, BS, offload=offload)
    waiting = seq(0, a + [1])
    assert kv.prefetch(waiting)
    assert kv.is_loading(waiting)
    reads = kv.take_offload_moves().read
    assert [h for h, _ in reads] == on_disk
    # Other traffic cannot take the three slots while the reads are out or after them.
    assert offload.ram.reserve(b"x" * 32) is None
    offload.absorb(TierReport(prefetched=[(h, slot, True) for h, slot in reads]))
    assert not kv.is_loading(waiting) and offload.ram.reserve(b"y" * 32) is None
    prefix = kv.find_cached_prefix(waiting)
    assert prefix.tier_hashes == on_disk
    assert kv.admit(waiting, prefix, 2)
    kv.take_offload_moves()
    assert offload.ram.reserve(b"z" * 32) is not None  # released once admitted
    assert offload.disk.hits == 3


def test_a_failed_read_is_a_miss_and_the_block_leaves_the_disk_index():
    a = list(range(100, 109))
    offload = KVOffloader(num_slots=4, block_size=BS, disk=True, on_disk=chain(a))
    kv = KVCacheManager(8, BS, offload=offload)
    waiting = seq(0, a + [1])
    kv.prefetch(waiting)
    reads = kv.take_offload_moves().read
    offload.absorb(TierReport(prefetched=[(reads[0][0], reads[0][1], False), (*reads[1], True)]))
    prefix = kv.find_cached_prefix(waiting)
    assert prefix.tier_hashes == []  # the chain breaks at the bad first block
    assert offload.disk.errors == 1 and offload.num_disk_blocks == 1
    assert not kv.prefetch(waiting)  # not read again


def test_a_failed_write_turns_the_disk_tier_off():
    offload = KVOffloader(num_slots=4, block_size=BS, disk=True, on_disk=[b"h" * 32])
    kv = KVCacheManager(3, BS, offload=offload)
    computed(kv, seq(0, list(range(100, 105))))
    computed(kv, seq(1, list(range(200, 209))))
    assert kv.take_offload_moves().write
    offload.absorb(TierReport(disk_failed=True))
    assert not offload.disk_enabled and offload.num_disk_blocks == 0
    computed(kv, seq(2, list(range(300, 309))))
    moves = kv.take_offload_moves()
    assert moves.store and not moves.write  # RAM goes on


def test_a_slot_stored_in_a_step_is_not_reused_by_that_step():
    """Two evictions of one step into a one-slot tier: the second is dropped, not stored over the
    first (whose disk write snapshots the slot after the step's stores)."""
    offload = KVOffloader(num_slots=1, block_size=BS, disk=True)
    offload.evicted(0, b"a" * 32)
    offload.evicted(1, b"b" * 32)
    moves = offload.take_moves()
    assert moves.store == [(0, 0)] and moves.write == [(0, b"a" * 32)]
    offload.evicted(2, b"c" * 32)  # a later step may reuse it
    assert offload.take_moves().store == [(2, 0)]
