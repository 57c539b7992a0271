"""Servers that never outlive the process that started them (tests, benchmarks).

A tritonserver (a frontend, Prometheus, a peer worker) runs in a session of its own, so that its
whole process group can be signalled at once; that also means nothing stops it when the process
that started it dies, and a killed benchmark or test run used to leave its tritonserver and its
Python-backend stubs running. Two guards:

- `die_with_parent()` (the child's `preexec_fn`): Linux's PR_SET_PDEATHSIG sends the child SIGTERM
  when its parent dies, however it dies (SIGKILL included); tritonserver then shuts down and its
  stubs with it. It is tied to the parent's thread that started the child, so start servers from
  a thread that lives as long as they do (the main thread, as fixtures and benchmarks do).
- `stop_on_signals` (in the parent): SIGTERM raises SystemExit, as SIGINT raises
  KeyboardInterrupt, so `finally` blocks and context managers stop the servers gracefully.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Looked up once in the parent: the hook runs between fork and exec, where little is safe to do.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None]:
    """The `preexec_fn` of a server started now: SIGTERM to it when this process dies (Linux
    only), including when it died between the fork and the hook (the child already re-parented)."""
    parent = os.getpid()

    def hook() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)

    return hook


def stop_on_signals() -> None:
    """In the main thread of a process that starts servers: SIGTERM exits through SystemExit (exit
    status 143), running `finally` blocks and `__exit__`s that stop them; SIGINT raises
    KeyboardInterrupt, also where the process inherited it ignored (a job a non-interactive shell
    put in the background, or a parent that ignores it: Python then leaves it ignored)."""

    def exit_now(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
    signal.signal(signal.SIGINT, signal.default_int_handler)
