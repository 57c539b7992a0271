"""The engine's side of the offload tier: the scheduler's index built from the runner's store,
and each step's report of the store's threads handed to it."""

from __future__ import annotations

import dataclasses

from backend_lib.llm.core.kv_offload import KVOffloader, OffloadMoves
from backend_lib.llm.core.scheduler import Scheduler, SchedulerOutput
from backend_lib.llm.core.stats import KVOffloadStats
from backend_lib.llm.execution.kv_offload_store import OffloadStore
from backend_lib.llm.execution.model_runner import ModelRunner

IDLE_READ_WAIT_S = 0.01
"""How long a step with nothing running waits for a disk read before scheduling (a sequence
waiting for its prefix is then the only work; without the wait the engine loop would spin)."""


def offloader_for(store: OffloadStore | None, block_size: int) -> KVOffloader | None:
    """The scheduler's index of this store's tiers (None: no tier)."""
    if store is None:
        return None
    on_disk = store.files.hashes() if store.files is not None else ()
    return KVOffloader(store.num_slots, block_size, store.files is not None, on_disk)


def absorb_tier_report(runner: ModelRunner, scheduler: Scheduler) -> None:
    """Before scheduling: what the store's writer and reader threads finished. A block read back
    counts only once every rank has read its shard of it intact."""
    offload, store = scheduler.kv_cache_manager.offload, runner.offload
    if offload.num_prefetching and not scheduler.running:
        store.wait_reads(IDLE_READ_WAIT_S)
    report = store.report()
    if report.prefetched:
        failed = runner.unread([(h, slot) for h, slot, _ in report.prefetched])
        report.prefetched = [(h, slot, ok and h not in failed) for h, slot, ok in report.prefetched]
    offload.absorb(report)


def tier_stats(store: OffloadStore, scheduler: Scheduler) -> KVOffloadStats:
    """The tier's counts now, from the scheduler's index and the store's byte counts."""
    offload, io = scheduler.kv_cache_manager.offload, store.io
    files = store.files
    return KVOffloadStats(
        external_queries=offload.external_queries,
        external_hits=offload.external_hits,
        ram=dataclasses.replace(offload.ram.counters),
        disk=dataclasses.replace(offload.disk),
        bytes_moved={
            "GPU_to_CPU": io.ram_bytes_stored,
            "CPU_to_GPU": io.ram_bytes_loaded,
            "CPU_to_DISK": io.disk_bytes_written,
            "DISK_to_CPU": io.disk_bytes_read,
        },
        copy_seconds=io.copy_seconds,
        ram_usage=offload.ram.num_used / offload.ram.num_slots,
        disk_usage=files.num_bytes / files.capacity_bytes
        if files and files.capacity_bytes
        else 0.0,
    )


def flush_to_disk(runner: ModelRunner, scheduler: Scheduler) -> None:
    """At shutdown: every rank writes its shard of the device pool's cached blocks that the disk
    tier lacks (a restart then finds every prefix the engine held). Nothing without a disk tier."""
    kv = scheduler.kv_cache_manager
    kv.offload.absorb(runner.offload.report())
    blocks = kv.offload.unwritten(kv.pool.cached_blocks())
    if blocks:
        runner.execute(SchedulerOutput(offload=OffloadMoves(flush=blocks)))
