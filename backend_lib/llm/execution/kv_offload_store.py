"""One rank's offload tier: host-memory slots beside the device KV pool, and the disk files.

The scheduler decides every move (core/kv_offload.py); this module performs them:
- in the step, before the forward: evicted device blocks copied into their RAM slots (`store`,
  one batched index_select / index_copy_ per tensor, as swaps are), a snapshot of those to be
  written to disk handed to the writer thread, then RAM hits copied into fresh device blocks
  (`load`). Pinned host memory on CUDA, so those copies are DMA transfers;
- on the writer thread: block files written (kv_tier_files.py), never holding the step;
- on the reader thread: disk blocks read back and checked into the RAM slots the scheduler
  reserved for them (`prefetch`), while their request waits outside the batch.
The threads' outcomes are collected by `report()`, which the engine passes to the scheduler.

An 8-bit cache's float32 scales live beside its values in RAM and in each file, as stored.
A write that fails (disk full, a path gone or read-only) turns the disk tier off with one log
line; RAM goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from backend_lib.llm.core.block_pool import BlockHash
from backend_lib.llm.core.kv_offload import OffloadMoves, TierReport
from backend_lib.llm.execution.kv_pool import KVPool, blocks_in
from backend_lib.llm.execution.kv_tier_files import BlockFiles, CorruptBlockFile
from backend_lib.llm.kv_offload_config import KVOffloadConfig

logger = logging.getLogger(__name__)

_BLOCK_DIM = 2


@dataclass
class TierIO:
    """Cumulative bytes moved by the tier and its failures (for the metrics)."""

    ram_bytes_stored: int = 0
    ram_bytes_loaded: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    copy_seconds: float = 0.0
    """Time the step thread spent on tier copies (stores, snapshots, loads)."""


class OffloadStore:
    """The RAM slots, the optional disk files, and the threads that write and read them."""

    def __init__(
        self,
        pool: KVPool,
        num_slots: int,
        files: BlockFiles | None = None,
        reports: bool = True,
    ) -> None:
        """`reports`: whether the threads' outcomes are collected for `report` (rank 0; the other
        ranks answer `await_reads` only)."""
        spec = pool.spec
        pin = pool.device.type == "cuda"
        self.num_slots, self.files = num_slots, files
        self.values = torch.zeros(spec.shape(num_slots), dtype=spec.dtype, pin_memory=pin)
        self._pairs = [(_bytes(pool.device_cache), _bytes(self.values))]
        if spec.quantized:
            self.scales = torch.zeros(
                spec.shape(num_slots)[:-1], dtype=torch.float32, pin_memory=pin
            )
            self._pairs.append((pool.device_scales, self.scales))
        self.device = pool.device
        self.block_bytes = sum(_block_bytes(ram) for _, ram in self._pairs)
        self.io = TierIO()
        self._report = TierReport()
        self._reports = reports
        self._read_results: dict[BlockHash, bool] = {}
        self._requested: set[BlockHash] = set()
        """Reads asked of this rank whose result `await_reads` has not taken yet."""
        self._lock = threading.Lock()
        self._reads_done = threading.Condition(self._lock)
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._threads = []
        if files is not None:
            for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
                thread = threading.Thread(target=target, name=f"kv-tier-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    # --- the step's copies -----------------------------------------------------------------------

    def store(self, moves: OffloadMoves) -> None:
        """Evicted device blocks into their RAM slots, then the disk writes' snapshots."""
        start = time.perf_counter()
        if moves.store:
            src, dst = _ids(moves.store, self.device, torch.device("cpu"))
            for device_t, ram_t in self._pairs:
                blocks = device_t.index_select(_BLOCK_DIM, src)
                ram_t.index_copy_(_BLOCK_DIM, dst, blocks.to("cpu"))
            self.io.ram_bytes_stored += len(moves.store) * self.block_bytes
        if moves.write and self.files is not None:
            slots = torch.tensor([slot for slot, _ in moves.write], dtype=torch.int64)
            # A copy: the slot may be reused before the writer thread gets to it.
            snapshot = [ram_t.index_select(_BLOCK_DIM, slots) for _, ram_t in self._pairs]
            self._writes.put(([h for _, h in moves.write], snapshot))
        self.write_resident(moves.flush)
        self.io.copy_seconds += time.perf_counter() - start

    def write_resident(self, blocks: list[tuple[int, BlockHash]]) -> None:
        """Write device blocks (id, hash) straight to disk: at shutdown, the prefix cache's
        blocks still in the pool, so that a restart finds them."""
        if not blocks or self.files is None:
            return
        ids = torch.tensor([block_id for block_id, _ in blocks], dtype=torch.int64)
        snapshot = [
            device_t.index_select(_BLOCK_DIM, ids.to(self.device)).to("cpu")
            for device_t, _ in self._pairs
        ]
        self._writes.put(([block_hash for _, block_hash in blocks], snapshot))

    def load(self, moves: OffloadMoves) -> None:
        """RAM hits into their fresh device blocks."""
        if not moves.load:
            return
        start = time.perf_counter()
        src, dst = _ids(moves.load, torch.device("cpu"), self.device)
        for device_t, ram_t in self._pairs:
            blocks = ram_t.index_select(_BLOCK_DIM, src)
            device_t.index_copy_(_BLOCK_DIM, dst, blocks.to(self.device, non_blocking=True))
        self.io.ram_bytes_loaded += len(moves.load) * self.block_bytes
        self.io.copy_seconds += time.perf_counter() - start

    # --- disk ------------------------------------------------------------------------------------

    def prefetch(self, reads: list[tuple[BlockHash, int]]) -> None:
        """Read these blocks from disk into their RAM slots, on the reader thread. The runner
        starts a step's reads before anything of the step can fail: every read asked for is
        reported, so no slot is ever freed while a read may still write into it."""
        with self._lock:
            self._requested.update(block_hash for block_hash, _ in reads)
        for read in reads:
            self._reads.put(read)

    def report(self) -> TierReport:
        """What the threads finished since the previous call."""
        with self._lock:
            report, self._report = self._report, TierReport()
        return report

    def await_reads(self, reads: list[tuple[BlockHash, int]]) -> set:
        """Wait until this rank has read each of these blocks it was asked to read; the hashes of
        those it could not read intact, or was never asked to (its step did not reach it). No
        timeout: a read that may still write into its slot must be waited for."""
        with self._reads_done:
            wanted = {block_hash for block_hash, _ in reads} & self._requested
            while not wanted <= self._read_results.keys():
                self._reads_done.wait(1.0)
            self._requested -= wanted
            ok = {block_hash for block_hash in wanted if self._read_results.pop(block_hash)}
        return {block_hash for block_hash, _ in reads} - ok

    def wait_reads(self, timeout_s: float) -> None:
        """Sleep until a read finishes (or `timeout_s` passes)."""
        with self._reads_done:
            if not self._report.prefetched:
                self._reads_done.wait(timeout_s)

    def close(self) -> None:
        """Stop the threads once the writes queued so far are done (a restart finds them)."""
        for work in (self._writes, self._reads):
            work.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            hashes, snapshot = job
            if self.files is None:
                continue  # turned off by an earlier failure
            for index, block_hash in enumerate(hashes):
                payload = b"".join(_block_payload(t, index) for t in snapshot)
                try:
                    removed = self.files.write(block_hash, payload)
                except Exception as exc:  # disk full, path gone or read-only (OSError), or a bug
                    logger.error(
                        "KV offload disk tier at %s turned off: writing a block failed: %s",
                        self.files.root,
                        exc,
                    )
                    self.files = None
                    with self._lock:
                        self._report.disk_failed = self._reports
                    break
                self.io.disk_bytes_written += len(payload)
                if self._reports:
                    with self._lock:
                        self._report.written.append(block_hash)
                        self._report.removed.extend(removed)

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            block_hash, slot = job
            try:
                ok = self._read_into(block_hash, slot)
            except Exception:  # the thread must answer every read (a rank waits for it)
                logger.exception("KV offload: reading a block file failed; recomputing it")
                ok = False
            with self._reads_done:
                self._read_results[block_hash] = ok
                if self._reports:
                    self._report.prefetched.append((block_hash, slot, ok))
                self._reads_done.notify_all()

    def _read_into(self, block_hash: BlockHash, slot: int) -> bool:
        files = self.files
        if files is None:
            return False
        try:
            payload = files.read(block_hash, self.block_bytes)
        except CorruptBlockFile as exc:
            logger.warning("KV offload: dropped a bad block file, recomputing it: %s", exc)
            return False
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for _, ram_t in self._pairs:
            dst = _bytes(ram_t).select(_BLOCK_DIM, slot)
            size = dst.numel()
            dst.copy_(data[offset : offset + size].view(dst.shape))
            offset += size
        self.io.disk_bytes_read += len(payload)
        return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (uint8, last dim scaled by the element size), a view."""
    return t.view(torch.uint8)


def _block_bytes(t: torch.Tensor) -> int:
    """Bytes of one block of a [L, 2, blocks, ...] tensor."""
    return t.numel() // t.shape[_BLOCK_DIM] * t.element_size() if t.shape[_BLOCK_DIM] else 0


def _block_payload(snapshot: torch.Tensor, index: int) -> bytes:
    return _bytes(snapshot.select(_BLOCK_DIM, index).contiguous()).numpy().tobytes()


def _ids(
    pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(pairs, dtype=torch.int64)
    return ids[:, 0].to(src_device), ids[:, 1].to(dst_device)


def build_offload_store(
    config: KVOffloadConfig | None,
    pool: KVPool,
    identity: dict,
    rank: int,
    staging_blocks: int,
) -> OffloadStore | None:
    """This rank's tier for the resolved settings (None: no tier). `identity`: what the disk
    tier's manifest must match to reuse files; `staging_blocks`: RAM slots a disk-only tier reads
    and writes through. Rank 0 collects the threads' reports for the scheduler; every rank keeps
    its own files (`rank<r>/`) and answers for its own reads."""
    if config is None:
        return None
    num_slots = blocks_in(config.ram_bytes, pool.spec) if config.ram_bytes else staging_blocks
    files = None
    if config.path is not None:
        files = BlockFiles(config.path, rank, identity, config.disk_bytes)
        logger.info(
            "KV offload disk tier at %s: %d block files %s",
            config.path,
            len(files.hashes()),
            "reused" if files.reused else "(a new or different engine's directory: emptied)",
        )
    return OffloadStore(pool, max(1, num_slots), files, reports=rank == 0)
