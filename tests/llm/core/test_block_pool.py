"""BlockPool: reference counts, LRU free queue, prefix-cache index and eviction."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_lib.llm.core.block_pool import BlockPool, hash_block


def test_hash_chains_parent_and_tokens():
    root = hash_block(None, [1, 2, 3])
    assert root == hash_block(None, [1, 2, 3])
    assert root != hash_block(None, [1, 2, 4])
    assert hash_block(root, [5]) != hash_block(hash_block(None, [1, 2, 4]), [5])
    assert hash_block(root, [5]) != hash_block(None, [5])
    # Independent reference: SHA-256 over the parent digest then the tokens as int64.
    ref = hashlib.sha256(root + b"".join(t.to_bytes(8, "little", signed=True) for t in [5, 70000]))
    assert hash_block(root, [5, 70000]) == ref.digest()


def test_allocate_and_free_count_references():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.touch([a[0]])
    pool.free(a)
    assert pool.blocks[a[0]].ref_count == 1 and pool.num_free_blocks == 3
    pool.free([a[0]])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])
    with pytest.raises(RuntimeError, match="cannot allocate 5 blocks"):
        pool.allocate(5)


def test_cached_blocks_survive_free_until_evicted_lru():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = []
    for i, block in enumerate(blocks[:3]):
        hashes.append(hash_block(hashes[-1] if hashes else None, [i]))
        pool.cache_block(block, hashes[-1], hashes[-2] if i else None, [i])
    # Freed tail first (as a finished sequence is): the tail is the least recently used.
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    # The uncached block is reused first, then cached ones, tail first.
    assert pool.free_block_ids() == [blocks[3], blocks[2], blocks[1], blocks[0]]
    assert pool.lookup(hashes[0], None, [0]) == blocks[0]
    assert pool.allocate(2) == [blocks[3], blocks[2]]
    assert pool.lookup(hashes[2], hashes[1], [2]) is None  # evicted
    assert pool.lookup(hashes[1], hashes[0], [1]) == blocks[1]
    # A hit revives a free cached block: it leaves the free queue.
    pool.touch([blocks[0]])
    assert pool.num_free_blocks == 1 and pool.free_block_ids() == [blocks[1]]


def test_lookup_compares_tokens_and_parent():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    parent = hash_block(None, [9])
    key = hash_block(parent, [1, 2])
    pool.cache_block(block, key, parent, [1, 2])
    assert pool.lookup(key, parent, [1, 2]) == block
    # Same key with other content (what a hash collision would look like) is a miss.
    assert pool.lookup(key, parent, [1, 3]) is None
    assert pool.lookup(key, None, [1, 2]) is None


def test_duplicate_content_is_indexed_once():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    key = hash_block(None, [1])
    pool.cache_block(a, key, None, [1])
    pool.cache_block(b, key, None, [1])
    assert pool.num_cached_blocks == 1 and pool.lookup(key, None, [1]) == a
    pool.free([a, b])
    assert pool.free_block_ids()[0] == b  # the unindexed duplicate is reused first


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "touch", "cache"]), st.integers(0, 7)),
        max_size=60,
    )
)
def test_random_operations_keep_counts_consistent(ops):
    """Against a reference: a plain dict of expected reference counts."""
    pool = BlockPool(8)
    refs = dict.fromkeys(range(8), 0)
    for op, arg in ops:
        held = [b for b, r in refs.items() if r > 0]
        if op == "alloc" and arg <= pool.num_free_blocks:
            for block in pool.allocate(arg):
                assert refs[block] == 0
                refs[block] = 1
        elif op == "free" and held:
            block = held[arg % len(held)]
            pool.free([block])
            refs[block] -= 1
        elif op == "touch":
            pool.touch([arg])
            refs[arg] += 1
        elif op == "cache" and held:
            block = held[arg % len(held)]
            pool.cache_block(block, hash_block(None, [block]), None, [block])
        assert [b.ref_count for b in pool.blocks] == [refs[i] for i in range(8)]
        assert sorted(pool.free_block_ids()) == [b for b, r in refs.items() if r == 0]
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.lookup(block.block_hash, None, [block.block_id]) == block.block_id
