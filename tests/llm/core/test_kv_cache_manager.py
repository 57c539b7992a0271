"""KVCacheManager: prefix lookup and admission, slot allocation, fork + copy-on-write, swapping."""

from __future__ import annotations

import itertools

import pytest

from backend_lib.llm.core.kv_cache_manager import KVCacheManager
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.sequence import Sequence

BS = 8
_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    return Sequence(next(_ids), "r", list(tokens), len(tokens), SamplingParams(), 0.0)


def compute(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """What one scheduled step does to the manager: slots, then (after the forward) caching."""
    assert kv.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    kv.cache_full_blocks(seq)


def admit_all(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit `seq` for its whole remaining prompt; returns the cached-prefix length."""
    prefix = kv.find_cached_prefix(seq)
    assert kv.admit(seq, prefix, seq.num_tokens - prefix.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return prefix.num_tokens


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.pool.blocks]


def test_prefix_hits_are_longest_full_block_prefix_and_counted_in_tokens():
    kv = KVCacheManager(16, BS)
    a = make_seq(range(100, 120))  # 2 full blocks + 4 tokens
    assert admit_all(kv, a) == 0
    b = make_seq(list(range(100, 116)) + [1, 2, 3])  # shares both full blocks
    c = make_seq(list(range(100, 108)) + [0] * 12)  # shares the first block only
    d = make_seq(range(200, 230))
    hits = [admit_all(kv, s) for s in (b, c, d)]
    assert hits == [16, 8, 0]
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[0] == a.block_table[0]
    assert kv.prefix_cache_queries == 20 + 19 + 20 + 30
    assert kv.prefix_cache_hits == 24
    assert ref_counts(kv)[a.block_table[0]] == 3


def test_hit_never_covers_the_last_token():
    kv = KVCacheManager(16, BS)
    a = make_seq(range(16))
    admit_all(kv, a)
    same = make_seq(range(16))
    prefix = kv.find_cached_prefix(same)
    assert prefix.num_tokens == 8  # the second block is recomputed to get logits
    longer = make_seq(range(17))
    assert kv.find_cached_prefix(longer).num_tokens == 16


def test_prefix_caching_disabled():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = make_seq(range(20))
    admit_all(kv, a)
    assert admit_all(kv, make_seq(range(20))) == 0
    assert kv.pool.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_freed_blocks_stay_cached_and_admission_counts_revived_blocks():
    kv = KVCacheManager(4, BS)
    a = make_seq(range(24))  # 3 full blocks
    admit_all(kv, a)
    kv.free(a)
    assert ref_counts(kv) == [0, 0, 0, 0] and kv.pool.num_free_blocks == 4
    other = make_seq([999])
    admit_all(kv, other)  # takes the one uncached free block
    b = make_seq(list(range(24)) + [5])
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 24
    # 3 revived + 1 new > 3 free: refused, nothing changed.
    assert not kv.admit(b, prefix, 1)
    assert b.block_table == [] and kv.pool.num_free_blocks == 3 and kv.prefix_cache_queries == 25
    kv.free(other)
    assert kv.admit(b, prefix, 1)
    assert b.num_computed_tokens == 24 and b.block_table[:3] == prefix.block_ids


def test_allocate_slots_grows_table_only_as_needed():
    kv = KVCacheManager(3, BS)
    seq = make_seq(range(5))
    admit_all(kv, seq)
    assert len(seq.block_table) == 1
    for token in range(3):  # positions 5..7 stay in block 0
        seq.append_token(token)
        compute(kv, seq, 1)
        assert len(seq.block_table) == 1
    seq.append_token(0)
    compute(kv, seq, 1)
    assert len(seq.block_table) == 2
    assert kv.num_blocks_for(seq.num_computed_tokens + 16) == 4
    assert not kv.allocate_slots(seq, 16)  # would need 2 more blocks, 1 free
    assert len(seq.block_table) == 2


def test_fork_shares_blocks_and_copies_on_first_write():
    kv = KVCacheManager(8, BS)
    parent = make_seq(range(12))  # block 0 full, block 1 holds 4 tokens
    admit_all(kv, parent)
    children = [make_seq(list(range(12)) + [50 + i]) for i in range(2)]
    parent.append_token(49)
    for child in children:
        kv.fork(parent, child)
        assert child.block_table == parent.block_table and child.num_computed_tokens == 12
    full, partial = parent.block_table
    assert ref_counts(kv)[full] == 3 and ref_counts(kv)[partial] == 3
    copies = []
    for seq in [children[0], parent, children[1]]:
        compute(kv, seq, 1)
        copies += kv.take_copies()
    # The first two writers copy the shared partial block; the last one owns it by then.
    assert [src for src, _ in copies] == [partial, partial]
    assert children[1].block_table[1] == partial
    assert children[0].block_table[1] == copies[0][1] and parent.block_table[1] == copies[1][1]
    assert len({s.block_table[1] for s in [parent, *children]}) == 3
    assert ref_counts(kv)[full] == 3  # full blocks are never written: still shared
    for seq in [parent, *children]:
        kv.free(seq)
    assert ref_counts(kv) == [0] * 8 and kv.pool.num_free_blocks == 8


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(8, BS)
    parent = make_seq(range(16))
    admit_all(kv, parent)
    child = make_seq(list(range(16)) + [7])
    parent.append_token(8)
    kv.fork(parent, child)
    compute(kv, child, 1)
    compute(kv, parent, 1)
    assert kv.take_copies() == []
    assert (
        child.block_table[:2] == parent.block_table[:2]
        and child.block_table[2] != parent.block_table[2]
    )


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(6, BS, num_host_blocks=4)
    seq = make_seq(range(20))
    admit_all(kv, seq)
    device_before = list(seq.block_table)
    assert kv.can_swap_out(seq)
    out_pairs = kv.swap_out(seq)
    host = kv.host_block_table(seq)
    assert out_pairs == list(zip(device_before, host, strict=True))
    assert seq.block_table == [] and kv.pool.usage == 0.0 and kv.host_pool.num_free_blocks == 1
    hog = make_seq(range(500, 548))  # evicts every device block, cached copies of `seq` included
    admit_all(kv, hog)
    kv.free(hog)
    assert kv.find_cached_prefix(make_seq(range(20))).num_tokens == 0
    seq.append_token(1)
    in_pairs = kv.swap_in(seq, 1)
    assert [h for h, _ in in_pairs] == host
    assert [d for _, d in in_pairs] == seq.block_table[:3] and len(seq.block_table) == 3
    assert kv.host_pool.num_free_blocks == 4 and kv.host_block_table(seq) == []
    # The swapped-in full blocks are findable in the prefix cache again.
    assert kv.find_cached_prefix(make_seq(range(20))).block_ids == seq.block_table[:2]


def test_swap_refused_when_pools_are_short():
    kv = KVCacheManager(4, BS, num_host_blocks=2)
    seq = make_seq(range(20))
    admit_all(kv, seq)
    assert not kv.can_swap_out(seq)  # 3 blocks, 2 host blocks
    small = make_seq(range(100, 110))
    kv.free(seq)
    admit_all(kv, small)
    kv.swap_out(small)
    hog = make_seq(range(300, 330))
    admit_all(kv, hog)  # takes all 4 device blocks
    small.append_token(0)
    assert kv.swap_in(small, 1) is None and kv.host_block_table(small) != []
    kv.free(small)  # freeing a swapped sequence releases its host blocks
    assert kv.host_pool.num_free_blocks == 2


@pytest.mark.parametrize("caching", [True, False])
def test_free_releases_everything(caching):
    kv = KVCacheManager(8, BS, enable_prefix_caching=caching)
    seqs = [make_seq(range(i, i + 13)) for i in range(3)]
    for seq in seqs:
        admit_all(kv, seq)
    for seq in seqs:
        kv.free(seq)
        assert seq.block_table == []
    assert ref_counts(kv) == [0] * 8 and kv.pool.num_free_blocks == 8
