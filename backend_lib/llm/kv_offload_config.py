"""The offload tier's settings (`kv_offloading_*` in an LLM's config.pbtxt), checked as a whole.

vLLM's names where vLLM has them: `kv_offloading_backend` (none | native) and
`kv_offloading_size` (GiB of host memory, the total over tensor-parallel ranks, as vLLM's). Ours:
`kv_offloading_path` (a directory for the disk tier; relative to the model directory) and
`kv_offloading_disk_size` (GiB of files in it, per rank). Every problem names its field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from backend_lib.config import ConfigError, require

GIB = 1 << 30
DISK_STAGING_STEPS = 2
"""A disk tier without host memory still reads and writes through RAM slots: this many steps'
worth of blocks (max_num_batched_tokens each)."""


class OffloadSettings(Protocol):
    """The LLMConfig fields the tier depends on (this module sits below config.py)."""

    kv_offloading_backend: str
    kv_offloading_size: float
    kv_offloading_path: str
    kv_offloading_disk_size: float
    enable_prefix_caching: bool
    speculative_config: str
    tensor_parallel_size: int

    @property
    def world_size(self) -> int: ...


@dataclass(frozen=True)
class KVOffloadConfig:
    """The resolved tier: what `KVOffloadConfig.of(config)` made of the settings."""

    ram_bytes: int
    """Host memory of this rank's RAM tier."""
    path: Path | None
    """The disk tier's directory (None: no disk tier)."""
    disk_bytes: int
    """Bytes of block files this rank may keep there."""

    @classmethod
    def of(cls, config: OffloadSettings, base_dir: Path | None = None) -> KVOffloadConfig | None:
        """The tier of `config` (None: kv_offloading_backend none); a relative path is resolved
        against `base_dir` and must be a writable directory (ConfigError naming
        kv_offloading_path otherwise)."""
        if config.kv_offloading_backend == "none":
            return None
        path = None
        if config.kv_offloading_path:
            path = Path(config.kv_offloading_path)
            if not path.is_absolute():
                path = Path(base_dir or ".") / path
            problem = check_writable(path)
            if problem is not None:
                raise ConfigError("kv_offloading_path", config.kv_offloading_path, problem)
        return cls(
            ram_bytes=int(config.kv_offloading_size * GIB / config.tensor_parallel_size),
            path=path,
            disk_bytes=int(config.kv_offloading_disk_size * GIB),
        )


def validate(config: OffloadSettings) -> None:
    """The checks that need no file system (LLMConfig.validate calls it)."""
    require(
        config.kv_offloading_backend in ("none", "native"),
        "kv_offloading_backend",
        config.kv_offloading_backend,
        "expected one of none, native",
    )
    for key in ("kv_offloading_size", "kv_offloading_disk_size"):
        require(getattr(config, key) >= 0, key, getattr(config, key), "must be >= 0 (GiB)")
    if config.kv_offloading_backend == "none":
        for key in ("kv_offloading_size", "kv_offloading_path", "kv_offloading_disk_size"):
            require(
                not getattr(config, key),
                key,
                getattr(config, key),
                "set, but kv_offloading_backend is none (native turns the tier on)",
            )
        return
    require(
        config.kv_offloading_size > 0 or bool(config.kv_offloading_path),
        "kv_offloading_size",
        config.kv_offloading_size,
        "must be > 0 (GiB of host memory) unless kv_offloading_path gives a disk tier",
    )
    require(
        bool(config.kv_offloading_path) == (config.kv_offloading_disk_size > 0),
        "kv_offloading_disk_size",
        config.kv_offloading_disk_size,
        "must be > 0 exactly when kv_offloading_path is set",
    )
    require(
        config.enable_prefix_caching,
        "kv_offloading_backend",
        config.kv_offloading_backend,
        "the tier holds prefix-cache blocks: needs enable_prefix_caching",
    )
    require(
        not config.speculative_config,
        "kv_offloading_backend",
        config.kv_offloading_backend,
        "not yet with speculative_config (a draft model's cache is not offloaded)",
    )


def check_writable(path: Path) -> str | None:
    """Why `path` cannot hold the disk tier (None: it can): it must be, or be creatable as, a
    directory where a file can be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"not a writable directory: {exc.strerror or exc}"
    return None
