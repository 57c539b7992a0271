"""The disk tier's files: one file per block hash, written atomically, checked when read, and
bounded in total size (least recently used removed first), under a manifest naming what they
were computed for.

Layout under `kv_offloading_path`, one directory per rank (each rank keeps its own K/V shard):
    rank<r>/manifest.json     {"format_version", "model", "dtype", "block_size", "num_layers", ...}
    rank<r>/<hash hex>.kvb    one block of rank r's shard

A file is a header (`HEADER`: magic, format version, the block hash, payload length, CRC-32 of the
payload) then the payload: the block's K/V bytes across all layers, then (8-bit caches) its
float32 scales. It is written to a temporary name and renamed, so a reader never sees half a
file under a block's name; a file cut short or altered later fails the length or CRC check and
is dropped, never served.

A directory whose manifest differs from this engine's (another model, dtype, block size, layout
or format version) is emptied of block files before use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

from backend_lib.llm.core.block_pool import BlockHash

FORMAT_VERSION = 1
MAGIC = b"KVTIERBK"
HEADER = struct.Struct("<8sI32sQI")
"""magic, format version, block hash (SHA-256), payload bytes, CRC-32 of the payload."""
SUFFIX = ".kvb"
MANIFEST = "manifest.json"


def checkpoint_fingerprint(model_dir: Path) -> str:
    """SHA-256 over a checkpoint's config.json and its weight files' names and sizes: what the
    K/V of a block depends on besides the cache layout (reading every weight would take long)."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for weights in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()


class CorruptBlockFile(Exception):
    """A block file that is missing, truncated, or fails its header or checksum check."""


class BlockFiles:
    """One rank's block files, least recently used first, within `capacity_bytes`. Safe to write
    from one thread while another reads."""

    def __init__(self, root: Path, rank: int, identity: dict, capacity_bytes: int) -> None:
        """Open (or start) the tier at `root` for an engine described by `identity`; files left
        by a different engine are removed."""
        self.root, self.capacity_bytes = Path(root), capacity_bytes
        self.dir = self.root / f"rank{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[BlockHash, int] = OrderedDict()
        self._lock = threading.Lock()  # guards _files and num_bytes, never held over I/O
        self.num_bytes = 0
        self.reused = self._open(identity)
        """Whether the files found were kept (the manifest matched)."""

    def _open(self, identity: dict) -> bool:
        manifest = {"format_version": FORMAT_VERSION, **identity}
        path = self.dir / MANIFEST
        try:
            matches = json.loads(path.read_text()) == manifest
        except (OSError, ValueError):
            matches = False
        if not matches:
            for stale in self.dir.glob(f"*{SUFFIX}"):
                stale.unlink(missing_ok=True)
            _write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode())
            return False
        found = []
        for file in self.dir.glob(f"*{SUFFIX}"):
            try:
                block_hash = bytes.fromhex(file.stem)
                stat = file.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self.num_bytes += size
        return True

    def hashes(self) -> list[BlockHash]:
        """The blocks on disk, least recently used first."""
        with self._lock:
            return list(self._files)

    def path_of(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def write(self, block_hash: BlockHash, payload: bytes) -> list[BlockHash]:
        """Write one block's file (atomically); returns the blocks removed to stay within the
        capacity. OSError (disk full, path gone, read-only) propagates: the caller turns the tier
        off."""
        header = HEADER.pack(MAGIC, FORMAT_VERSION, block_hash, len(payload), zlib.crc32(payload))
        _write_atomic(self.path_of(block_hash), header + payload)
        size = HEADER.size + len(payload)
        removed = []
        with self._lock:
            self.num_bytes += size - self._files.pop(block_hash, 0)
            self._files[block_hash] = size
            while self.num_bytes > self.capacity_bytes and len(self._files) > 1:
                oldest = next(iter(self._files))
                self.num_bytes -= self._files.pop(oldest)
                removed.append(oldest)
        for block_hash in removed:
            with contextlib.suppress(OSError):
                self.path_of(block_hash).unlink()
        return removed

    def read(self, block_hash: BlockHash, payload_bytes: int) -> bytes:
        """The block's payload, checked; CorruptBlockFile (the file is then removed) when the
        file is missing, cut short, longer than it should be, or fails its checksum."""
        path = self.path_of(block_hash)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._forget(block_hash)
            raise CorruptBlockFile(f"{path.name}: {exc.strerror or exc}") from None
        problem = _check(data, block_hash, payload_bytes)
        if problem is not None:
            self._remove(block_hash)
            raise CorruptBlockFile(f"{path.name}: {problem}")
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        return data[HEADER.size :]

    def _remove(self, block_hash: BlockHash) -> None:
        with contextlib.suppress(OSError):
            self.path_of(block_hash).unlink()
        self._forget(block_hash)

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self.num_bytes -= self._files.pop(block_hash, 0)


def _check(data: bytes, block_hash: BlockHash, payload_bytes: int) -> str | None:
    """What is wrong with a block file's bytes (None: nothing)."""
    if len(data) < HEADER.size:
        return f"truncated header ({len(data)} bytes)"
    magic, version, stored_hash, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        return "not a block file of this format version"
    if stored_hash != block_hash:
        return "holds another block"
    if length != payload_bytes or len(data) != HEADER.size + length:
        return f"length {len(data) - HEADER.size} bytes, expected {payload_bytes}"
    if zlib.crc32(memoryview(data)[HEADER.size :]) != crc:
        return "checksum mismatch"
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name beside `path`, then rename over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
