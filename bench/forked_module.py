"""`python -m <module> <args>` without a new interpreter: a child forked from the suite, which
has imported the heavy libraries once (`warm_up`), runs the module as `__main__`.

A benchmark process spends 5-10 s importing torch, transformers and this project before its
first measurement (more on a loaded machine); the suite runs 25 of them in turn. Forked, each
child shares those imports and starts at once, while staying a process of its own: its own
threads, its own torch settings, its own crash. The child runs its module as a fresh interpreter
would: `sys.argv`, new stdout and stderr, at its end threading's exit hooks, non-daemon threads
joined and its atexit handlers, with the exit code of SystemExit. None of the parent's atexit
handlers run there (a test runner's would clean its own temp dirs), so the warm imports'
module-level ones do not either: the project's (the grammar compile pools' close) have a second
line, their workers die with the process. Nothing warm may have started threads or touched a GPU:
`warm_up` only imports.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO

WARM_IMPORTS = (
    "numpy",
    "torch",
    "transformers",
    "safetensors.torch",
    "tokenizers",
    "tooling.checkpoints",
    "backend_lib.llm.engine.llm_engine",
)
"""What the suite imports before forking its benchmarks (what nearly all of them import)."""


def warm_up() -> None:
    """Import WARM_IMPORTS in this process (once; later calls cost nothing)."""
    for name in WARM_IMPORTS:
        importlib.import_module(name)


class ForkedModule:
    """A running `python -m module args` forked from this process: `stdout` (text, stderr
    merged), and Popen's `poll`, `wait`, `terminate` and `kill`."""

    def __init__(
        self,
        module: str,
        args: list[str],
        cwd: Path | None = None,
        preexec: Callable[[], None] | None = None,
    ):
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _run_child(module, args, write_fd, cwd, preexec)  # never returns
        os.close(write_fd)
        self.pid = pid
        self.stdout: IO[str] = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.stdout.name, timeout)
            time.sleep(0.02)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


def _run_child(
    module: str,
    args: list[str],
    out_fd: int,
    cwd: Path | None,
    preexec: Callable[[], None] | None,
):
    """In the forked child: run `module` as __main__ in `cwd` with its output on `out_fd`; exit
    with its code."""
    code = 1
    try:
        if preexec is not None:
            preexec()
        if cwd is not None:
            os.chdir(cwd)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        atexit._clear()  # the parent's handlers are the parent's
        # New streams on the new descriptors (the parent's may be anything: a test's capture).
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
        sys.argv = [module, *args]
        code = _main(module)
        # As an interpreter's exit does: threading's exit hooks (which stop idle thread-pool
        # workers), the non-daemon threads joined, then the atexit handlers.
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _main(module: str) -> int:
    """Run `module` as __main__; its exit code (SystemExit's, 1 on an exception)."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0
