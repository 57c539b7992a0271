"""tritonserver instances started by tests, registered so a failing test can print their logs."""

from __future__ import annotations

from pathlib import Path

from tooling.tritonserver import TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
"""The committed repository: what `make serve` serves."""

live_servers: list[TritonServer] = []
"""Servers started and not yet stopped (tests/conftest.py prints their log tails on failure)."""


def start_server(repository: Path, extra_args=(), env=None) -> TritonServer:
    server = TritonServer(repository, extra_args=extra_args, env=env)
    try:
        server.start()
    except Exception:
        print(server.log_tail(300))
        raise
    live_servers.append(server)
    return server


def stop_server(server: TritonServer) -> None:
    """Stop it, then fail if any of its stubs crashed on the way (a stub's crash handler writes
    "Segfault encountered" and a native stack to the server's log)."""
    server.stop()
    if server in live_servers:
        live_servers.remove(server)
    log = server.log_text()
    crash = log.find("Segfault encountered")
    assert crash < 0, (
        f"a stub of {server.repository} crashed:\n{log[max(0, crash - 2000) : crash + 3000]}"
    )
