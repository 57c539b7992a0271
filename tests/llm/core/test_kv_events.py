"""KV cache events (core/kv_events.py) from the scheduler on the fake runner: an independent
reader built from vLLM's schema (tests/llm/kv_event_schema.py) rebuilds, from the encoded batches
alone, exactly the set of blocks in the engine's prefix cache after every step of a random
workload with shared prefixes, LoRA namespaces and evictions; stored blocks chain as the pool's
hashes do and carry their tokens."""

from __future__ import annotations

import random

import msgspec

from backend_lib.llm.core.kv_events import KVEventLog
from backend_lib.llm.lora.request import LoRARequest
from tests.llm.core.scheduler_helpers import BS, FakeRunner, make_scheduler, make_seq, step
from tests.llm.kv_event_schema import BlockStored, ReplicaView

ENCODER = msgspec.msgpack.Encoder()


def test_a_reader_of_the_events_alone_rebuilds_the_prefix_cache_after_every_step():
    rng = random.Random(7)
    sched = make_scheduler(
        num_blocks=24, max_model_len=64, max_num_seqs=4, enable_lora=True, max_loras=2
    )
    kv = sched.kv_cache_manager
    log = KVEventLog(BS, "CPU")
    kv.record_events(log)
    runner, view = FakeRunner(sched), ReplicaView()
    shared = [rng.randrange(3, 90) for _ in range(2 * BS)]
    adapters = [None, LoRARequest("a", 1, "", adapter=None)]
    stored_any = removed_any = False
    for k in range(60):
        if rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.6 else []) + [
                rng.randrange(3, 90) for _ in range(rng.randint(1, 2 * BS))
            ]
            seq = make_seq(prompt, max_tokens=rng.randint(1, 12))
            seq.lora_request = rng.choice(adapters)
            sched.add(seq)
        if sched.has_unfinished():
            step(sched, runner)
        batch = log.take()
        if batch is None:
            continue
        decoded = view.apply(ENCODER.encode(batch))
        stored_any |= any(isinstance(e, BlockStored) for e in decoded.events)
        removed_any |= any(type(e).__name__ == "BlockRemoved" for e in decoded.events)
        assert set(view.blocks) == kv.pool.cached_hashes(), f"step {k}"
    for _ in range(500):
        if not sched.has_unfinished():
            break
        step(sched, runner)
        batch = log.take()
        if batch is not None:
            view.apply(ENCODER.encode(batch))
    assert not sched.has_unfinished()
    assert set(view.blocks) == kv.pool.cached_hashes()
    assert stored_any and removed_any  # the pool was small enough to evict
    pool_blocks = {b.block_hash: b for b in kv.pool.blocks if b.block_hash is not None}
    for block_hash, block in view.blocks.items():
        cached = pool_blocks[block_hash]
        assert tuple(block["tokens"]) == cached.token_ids
        if block["parent"] is not None:
            assert block["parent"] == cached.parent_hash
    lora_ids = {block["lora_id"] for block in view.blocks.values()}
    assert lora_ids <= {None, 1}


def test_the_first_batch_clears_and_consecutive_blocks_of_a_chain_merge():
    sched = make_scheduler(num_blocks=16, max_model_len=64)
    log = KVEventLog(BS, "GPU")
    sched.kv_cache_manager.record_events(log)
    runner = FakeRunner(sched)
    seq = make_seq(range(3 * BS + 1), max_tokens=1)
    sched.add(seq)
    step(sched, runner)
    events = ReplicaView().apply(ENCODER.encode(log.take())).events
    assert type(events[0]).__name__ == "AllBlocksCleared"
    (stored,) = events[1:]
    assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
    assert stored.token_ids == list(range(3 * BS)) and stored.block_size == BS
    assert stored.medium == "GPU" and stored.lora_id is None
    assert log.take() is None  # nothing new
