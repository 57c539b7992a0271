"""The peers' own environment, `.venv-peers`: built on first use from bench/peers/requirements.txt.

It is never mixed into the runtime's dependencies (optimum-intel pins an older transformers). A
stamp holding the hash of the requirements marks a finished build; a changed requirements file
rebuilds it. Each step is printed; a failed step raises `PeersUnavailable` naming it. The directory
holds a `.gitignore` of its own, as does the conversion cache (`.cache/bench-peers/`).

    python -m bench.peers.env     # build (or check) it now
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from bench.output import progress

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
NO_DEPS = Path(__file__).with_name("no-deps.txt")
"""Installed without their dependencies, after REQUIREMENTS (the file says why)."""
VENV = Path(os.environ.get("BENCH_PEERS_VENV", REPO_ROOT / ".venv-peers"))
CACHE = Path(os.environ.get("BENCH_PEERS_CACHE", REPO_ROOT / ".cache" / "bench-peers"))
STAMP = ".bench-peers-stamp"
CHECK_IMPORTS = "import openvino, openvino_genai, ctranslate2, onnxruntime, optimum.intel"
PIP_TIMEOUT_S = 1800


class PeersUnavailable(RuntimeError):
    """The peer systems cannot run; the message says which step failed and why."""


def python() -> Path:
    """The peers' interpreter, building the environment first if needed."""
    ensure()
    return VENV / "bin" / "python"


def ensure() -> None:
    """Build `.venv-peers` unless a finished build of the current requirements is there."""
    stamp = VENV / STAMP
    wanted = requirements_hash()
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return
    progress(f"peers: building {VENV} from {REQUIREMENTS.relative_to(REPO_ROOT)} (first use)")
    if not (VENV / "bin" / "python").exists():
        run_step("create the virtual environment", [sys.executable, "-m", "venv", str(VENV)], 300)
    ignore_all(VENV)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    run_step("pip install the pinned peers", [*pip, "-q", "-r", str(REQUIREMENTS)], PIP_TIMEOUT_S)
    run_step("pip install --no-deps", [*pip, "-q", "--no-deps", "-r", str(NO_DEPS)], PIP_TIMEOUT_S)
    run_step("import the peers", [str(VENV / "bin" / "python"), "-c", CHECK_IMPORTS], 300)
    stamp.write_text(wanted + "\n")
    progress(f"peers: {VENV} ready")


def ignore_all(directory: Path) -> None:
    """Make git ignore `directory` whatever the repository's .gitignore says."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".gitignore").write_text("*\n")


def requirements_hash() -> str:
    """What a build depends on: the pins."""
    return hashlib.sha256(REQUIREMENTS.read_bytes() + NO_DEPS.read_bytes()).hexdigest()


def run_step(name: str, command: list[str], timeout: float) -> None:
    progress(f"peers: {name}: {' '.join(command)}")
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeersUnavailable(f"building {VENV} failed at step '{name}': {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise PeersUnavailable(
            f"building {VENV} failed at step '{name}' (exit {proc.returncode}): " + " | ".join(tail)
        )


if __name__ == "__main__":
    try:
        print(python())
    except PeersUnavailable as exc:
        raise SystemExit(str(exc)) from exc
