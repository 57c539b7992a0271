"""Converted peer models, cached under `.cache/bench-peers/<target>-<key>/` (never in git): the key
hashes the checkpoint's files, the peers' pinned requirements and the conversion code, so a
checkpoint is converted once per target and a changed pin or converter converts it again."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from bench.output import progress
from bench.peers import env

CONVERT = Path(__file__).with_name("convert.py")
DONE = "conversion.json"
TIMEOUT_S = 1200


def converted(target: str, source: Path) -> Path:
    """The `target` conversion of the checkpoint in `source` (see bench.peers.convert)."""
    dest = env.CACHE / f"{target}-{fingerprint(source)}"
    if (dest / DONE).exists():
        return dest
    env.ignore_all(env.CACHE)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    command = [str(env.python()), "-m", "bench.peers.convert", target, str(source), str(partial)]
    progress(f"peers: converting {source} ({target}) into {dest}")
    try:
        proc = subprocess.run(
            command, cwd=env.REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise env.PeersUnavailable(f"converting for {target} timed out: {exc}") from exc
    if proc.returncode != 0 or not (partial / DONE).exists():
        shutil.rmtree(partial, ignore_errors=True)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        raise env.PeersUnavailable(
            f"converting for {target} failed (exit {proc.returncode}): " + " | ".join(tail)
        )
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


def fingerprint(source: Path) -> str:
    digest = hashlib.sha256()
    digest.update(env.requirements_hash().encode())
    digest.update(CONVERT.read_bytes())
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]
