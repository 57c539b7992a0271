"""bench/forked_module.py: a module run as `python -m` would run it, in a child forked from a warm
process: its argv, output, exit code, atexit handlers, non-daemon threads and idle thread-pool
workers as at an interpreter's exit, then its atexit handlers and none of the parent's;
killable."""

from __future__ import annotations

import atexit
import subprocess
import sys
import textwrap

import pytest

from bench.forked_module import ForkedModule

PROBE = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    atexit.register(lambda: print("child atexit", flush=True))
    # A thread pool a library module keeps (its idle workers are not daemon threads).
    import json
    json.probe_pool = ThreadPoolExecutor(2)
    json.probe_pool.submit(print, "pooled", flush=True).result()
    def late():
        time.sleep(0.2)
        print("thread done", flush=True)
    threading.Thread(target=late).start()
    print("argv", sys.argv[1:], "main", __name__, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "forked_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "forked_probe"


def test_runs_the_module_as_main_with_its_argv_exit_code_threads_and_atexit(probe, tmp_path):
    marker = tmp_path / "parent-atexit-ran"

    def parent_handler():  # e.g. pytest's: it removes old temp dirs
        marker.write_text("ran")

    atexit.register(parent_handler)
    try:
        child = ForkedModule(probe, ["3", "--flag"], cwd=tmp_path)
        output = child.stdout.read()
        assert child.wait(timeout=30) == 3
    finally:
        atexit.unregister(parent_handler)
    assert output.splitlines() == [
        "pooled",
        "argv ['3', '--flag'] main __main__",
        "to stderr",
        "thread done",  # joined before the atexit handlers, as at an interpreter's exit
        "child atexit",
    ]
    assert not marker.exists()  # the parent's handlers stay the parent's


def test_an_exception_is_exit_code_one_with_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "forked_raiser.py").write_text("raise ValueError('bad benchmark')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    child = ForkedModule("forked_raiser", [])
    output = child.stdout.read()
    assert child.wait(timeout=30) == 1
    assert "ValueError: bad benchmark" in output


def test_a_hung_child_times_out_and_is_killed(tmp_path, monkeypatch):
    (tmp_path / "forked_sleeper.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    child = ForkedModule("forked_sleeper", [])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.3)
    assert child.poll() is None
    child.kill()
    assert child.wait(timeout=30) == -9
    assert sys.modules.get("forked_sleeper") is None  # it ran in the child only
