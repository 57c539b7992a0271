"""The disk tier's block files: what is written reads back; a file altered or cut short after
the write fails its check, is removed and is never returned; the directory stays within its size
by dropping the least recently used files; a manifest from another engine empties it (each rank
its own directory and manifest)."""

from __future__ import annotations

import hashlib
import json

import pytest

from backend_lib.llm.execution.kv_tier_files import (
    HEADER,
    MANIFEST,
    BlockFiles,
    CorruptBlockFile,
)

IDENTITY = {"model": "abc", "dtype": "torch.float32", "block_size": 8}


def h(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def test_a_written_block_reads_back_and_leaves_no_temporary_file(tmp_path):
    files = BlockFiles(tmp_path, 0, IDENTITY, 1 << 20)
    files.write(h(1), b"kv" * 50)
    assert files.read(h(1), 100) == b"kv" * 50
    names = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert names == sorted([f"{h(1).hex()}.kvb", MANIFEST])


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: d[:-1], "length"),
        (lambda d: d[: HEADER.size - 3], "truncated header"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
        (lambda d: d + b"x", "length"),
        (lambda d: b"NOTABLOK" + d[8:], "format"),
    ],
)
def test_a_damaged_file_is_refused_and_removed(tmp_path, damage, problem):
    files = BlockFiles(tmp_path, 0, IDENTITY, 1 << 20)
    files.write(h(1), bytes(range(100)))
    path = files.path_of(h(1))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptBlockFile, match=problem):
        files.read(h(1), 100)
    assert not path.exists() and h(1) not in files.hashes()


def test_a_file_holding_another_block_is_refused(tmp_path):
    files = BlockFiles(tmp_path, 0, IDENTITY, 1 << 20)
    files.write(h(1), b"a" * 10)
    files.path_of(h(1)).rename(files.path_of(h(2)))
    files.write(h(3), b"c" * 10)
    with pytest.raises(CorruptBlockFile, match="another block"):
        files.read(h(2), 10)


def test_the_least_recently_used_files_go_first_to_stay_within_the_size(tmp_path):
    size = HEADER.size + 100
    files = BlockFiles(tmp_path, 0, IDENTITY, 3 * size)
    for i in range(3):
        files.write(h(i), bytes(100))
    files.read(h(0), 100)  # now the most recently used
    assert files.write(h(3), bytes(100)) == [h(1)]
    assert files.hashes() == [h(2), h(0), h(3)] and files.num_bytes == 3 * size
    assert not files.path_of(h(1)).exists()


def test_a_restart_keeps_files_of_the_same_engine_and_empties_another_engines(tmp_path):
    files = BlockFiles(tmp_path, 0, IDENTITY, 1 << 20)
    files.write(h(1), b"x" * 10)
    again = BlockFiles(tmp_path, 0, IDENTITY, 1 << 20)
    assert again.reused and again.hashes() == [h(1)]
    other = BlockFiles(tmp_path, 0, IDENTITY | {"block_size": 16}, 1 << 20)
    assert not other.reused and other.hashes() == []
    assert not list((tmp_path / "rank0").glob("*.kvb"))
    assert json.loads((tmp_path / "rank0" / MANIFEST).read_text())["block_size"] == 16
