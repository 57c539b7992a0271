"""`server_model_control_mode`: the hosting tritonserver's --model-control-mode, read from that
process's own command line (both spellings of the flag; the server's default when unset)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend_lib.model_context import server_model_control_mode


@pytest.mark.parametrize(
    ("flags", "mode"),
    [
        (["--model-control-mode=explicit", "--load-model=*"], "explicit"),
        (["--model-control-mode", "POLL"], "poll"),
        (["--model-repository=/models"], "none"),
    ],
)
def test_the_mode_is_read_from_the_servers_command_line(flags, mode):
    # A stand-in process with the server's flags on its command line (read once it runs: before
    # its exec, /proc shows the parent's).
    code = "import time; print('up', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code, *flags], stdout=subprocess.PIPE)
    try:
        assert process.stdout.readline() == b"up\n"
        assert server_model_control_mode(process.pid) == mode
    finally:
        process.kill()
        process.wait()


def test_a_process_gone_reads_as_the_default():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert server_model_control_mode(process.pid) == "none"
