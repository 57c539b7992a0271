"""A test or benchmark process that starts a tritonserver and is then killed takes the server with
it (tooling/child_process.py): on SIGTERM and SIGINT it stops the server on its way out, and when
it dies outright (SIGKILL) the server gets SIGTERM from the kernel. Before, the server lived on in
its own session, its parent gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tooling.repository import REPO_ROOT

pytestmark = pytest.mark.e2e

PARENT = """
import sys, time
from tooling.child_process import stop_on_signals
from tooling.tritonserver import TritonServer

stop_on_signals()
with TritonServer(sys.argv[1]) as server:
    print(server.process.pid, flush=True)
    while True:
        time.sleep(1)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" not in status.read()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "kill_with", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["term", "int", "kill"]
)
def test_the_server_dies_with_the_process_that_started_it(tmp_path, kill_with):
    repository = tmp_path / "empty-repository"
    repository.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(repository)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        # As a shell's background job: SIGINT ignored on entry, which must not keep it alive.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        server_pid = int(parent.stdout.readline())
        assert alive(server_pid)
        os.kill(parent.pid, kill_with)
        parent.wait(
            timeout=120
        )  # its server stops within 30 s (then is killed), on a busy machine too
        deadline = time.monotonic() + 45
        while alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(server_pid), f"tritonserver {server_pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
