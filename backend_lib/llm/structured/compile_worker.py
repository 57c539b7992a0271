"""Constraint compilation in worker processes, so that no compile can stall the engine.

xgrammar compiles a constraint (a JSON schema, regex or EBNF grammar) for one tokenizer. Most take
milliseconds, but some cost seconds or more: a schema string `pattern` such as
`^(a|b|ab|ba){1,5000}$` spends about 10 s turning the regex into a grammar. `CompileWorkers`
runs compiles in up to `max_workers` child processes (one constraint at a time each, niced so
that the engine's own threads win the CPU), ships each `CompiledGrammar` back through xgrammar's
JSON serialization and hands it over as a `concurrent.futures.Future`. A compile whose worker
has spent its timeout in CPU seconds is stopped by killing the worker, which is replaced when
the next job needs one.

A worker is `python -m backend_lib.llm.structured.compile_worker <fd> <parent pid>`, talking
over a socket pair (`multiprocessing.connection.Connection` framing, pickled tuples):

    worker -> ("hello",)                    xgrammar imported
    parent -> tokenizer info JSON           xgr.TokenizerInfo.serialize_json()
    worker -> ("ready",)                    its GrammarCompiler built
    parent -> (kind, text, whitespace)      one constraint (StructuredOutputsParams.cache_key)
    worker -> ("ok", grammar JSON, seconds) or ("error", message)

The first constraint starts all the workers (so that the second is warm when two constraints
arrive together); a killed or dead one is replaced when the next constraint comes; a model that
never sees a constraint starts none. Workers never outlive their parent: they ask the kernel
for SIGKILL when the thread that started them (the pool's manager thread) ends (Linux
PR_SET_PDEATHSIG), an idle one exits when its socket closes, `close()` kills them, and every
open pool is closed at interpreter exit.

Pools are shared within a process by tokenizer (`acquire_pool` / `release_pool`): engines on the
same tokenizer (tests, benchmarks) reuse warm workers; the last release closes the pool.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the parent imports xgrammar anyway; the worker only once it has started
    import xgrammar as xgr

logger = logging.getLogger(__name__)

DEFAULT_WORKERS = 2
"""Worker processes per tokenizer (each compiles one constraint at a time)."""
WORKER_NICE = 10
"""Niceness a worker adds to its own (start included): its import of xgrammar and its compiles
yield the CPU to the engine and Triton's threads."""
START_TIMEOUT_S = 120.0
"""A worker not ready after this long (importing xgrammar, building its compiler) is killed, and
the constraints waiting for one fail."""
BOUNDED_WHITESPACE = 2
"""Free whitespace allowed in a row between JSON tokens when a request leaves
`disable_any_whitespace` unset (see StructuredOutputsParams)."""
_PDEATHSIG = 1  # PR_SET_PDEATHSIG of <linux/prctl.h>
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MIN_RECHECK_S = 0.05
"""Shortest wait before looking again at a worker's CPU time below its budget."""


class CompileError(Exception):
    """A constraint that cannot be compiled (xgrammar's message, cleaned)."""


class CompileTimeout(CompileError):
    """The compile ran past its timeout; its worker was killed."""


Key = tuple[str, str, "bool | None"]
"""(kind, text, disable_any_whitespace): what a worker compiles, as
StructuredOutputsParams.cache_key."""


def compile_constraint(compiler: xgr.GrammarCompiler, key: Key) -> xgr.CompiledGrammar:
    """`key` compiled by `compiler` (in a worker, or in-process for `GrammarCompiler.compile`).

    json_object is the schema {"type": "object"} (as vLLM compiles it). Whitespace of the JSON
    kinds: True none (compact separators), False any (xgrammar's and vLLM's default), None at most
    BOUNDED_WHITESPACE characters in a row."""
    kind, text, no_whitespace = key
    if kind in ("json", "json_object"):
        schema = text if kind == "json" else '{"type": "object"}'
        if no_whitespace is None:
            return compiler.compile_json_schema(
                schema, any_whitespace=True, max_whitespace_cnt=BOUNDED_WHITESPACE
            )
        return compiler.compile_json_schema(schema, any_whitespace=not no_whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)  # grammar, and choice as a grammar


_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/file.cc:42: "


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


# --- the parent side ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    key: Key
    timeout_s: float
    future: Future = field(default_factory=Future)
    """-> (CompiledGrammar, seconds the worker spent); CompileError on failure."""


@dataclass(frozen=True)
class _Compiled:
    """A worker's serialized grammar, not yet deserialized."""

    text: str
    seconds: float


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    job: _Job | None = None
    deadline: float = 0.0
    """time.monotonic() at which its job's CPU time is next checked (it cannot have spent its
    budget before), or past which its start is given up."""
    job_cpu_start: float | None = None
    """Its CPU seconds when its job was handed over; None where /proc cannot tell."""

    def job_cpu_seconds(self) -> float | None:
        """CPU seconds its current job has used; None where /proc cannot tell."""
        now = cpu_seconds(self.process.pid)
        if now is None or self.job_cpu_start is None:
            return None
        return now - self.job_cpu_start


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of a live process (Linux /proc); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14, 15)


class CompileWorkers:
    """Compile worker processes for one tokenizer; `submit` is thread-safe and never blocks."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_workers: int = DEFAULT_WORKERS):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.tokenizer_info = tokenizer_info
        self.max_workers = max_workers
        self._info_json: str | None = None
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_started = 0
        """Workers started so far (replacements included)."""
        _OPEN.add(self)

    def submit(self, key: Key, timeout_s: float) -> Future:
        """Compile `key` in a worker; the future's result is (CompiledGrammar, seconds), or a
        CompileError (CompileTimeout once a worker has spent `timeout_s` on it)."""
        job = _Job(key, timeout_s)
        with self._lock:
            if self._closed:
                job.future.set_exception(CompileError("the grammar compile workers are shut down"))
                return job.future
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="grammar-compile", daemon=True
                )
                self._thread.start()
        self._wake()
        return job.future

    @property
    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers]

    @property
    def num_busy(self) -> int:
        """Constraints queued or compiling."""
        with self._lock:
            return len(self._queue) + sum(w.job is not None for w in self._workers)

    @property
    def num_ready(self) -> int:
        """Workers started and ready to compile."""
        with self._lock:
            return sum(w.ready for w in self._workers)

    @property
    def num_compiling(self) -> int:
        """Constraints a worker is compiling now."""
        with self._lock:
            return sum(w.job is not None for w in self._workers)

    def close(self, timeout: float = 30.0) -> None:
        """Fail what waits, kill every worker and end the manager thread (idempotent)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        _OPEN.discard(self)
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        else:
            self._shutdown()

    # --- manager thread ---------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        except Exception:  # a bug here must not leave jobs hanging or workers behind
            logger.exception("grammar compile manager failed")
        finally:
            with self._lock:
                self._closed = True  # later submissions fail at once
            _OPEN.discard(self)
            self._shutdown()

    def _loop_once(self) -> bool:
        finished: list[tuple[Future, Any, bool]] = []  # (future, value, is_error)
        with self._lock:
            if self._closed:
                return False
            self._dispatch(finished)
            waitables = [self._wake_r, *(w.conn for w in self._workers)]
            deadlines = [w.deadline for w in self._workers if w.job is not None or not w.ready]
        timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        ready = wait(waitables, 0 if finished else timeout)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError, OSError):
                while self._wake_r.recv(4096):
                    pass
        with self._lock:
            for worker in list(self._workers):
                if worker.conn in ready:
                    self._receive(worker, finished)
            now = time.monotonic()
            for worker in list(self._workers):
                due = (worker.job is not None or not worker.ready) and now >= worker.deadline
                if due and not self._extend(worker, now):
                    self._expire(worker, finished)
        for future, value, is_error in finished:  # outside the lock: callbacks run here
            if isinstance(value, _Compiled):
                try:
                    value = (_deserialize(value.text, self.tokenizer_info), value.seconds)
                except Exception as exc:
                    value, is_error = CompileError(clean_error(exc)), True
            if is_error:
                future.set_exception(value)
            else:
                future.set_result(value)
        return True

    def _dispatch(self, finished: list) -> None:
        """Hand queued jobs to idle ready workers; while jobs come, keep the pool full (a new
        job starts the missing workers, e.g. a killed one's replacement). Locked."""
        if self._queue:
            while len(self._workers) < self.max_workers:
                try:
                    self._workers.append(self._start_worker())
                except OSError as exc:  # no interpreter to run, no processes left, ...
                    logger.exception("cannot start a grammar compile worker")
                    if not self._workers:
                        error = CompileError(f"cannot start a grammar compile worker: {exc}")
                        while self._queue:
                            finished.append((self._queue.popleft().future, error, True))
                    break
        for worker in self._workers:
            if not self._queue:
                return
            if worker.ready and worker.job is None:
                job = self._queue.popleft()
                try:
                    worker.conn.send(job.key)
                except OSError:  # it died meanwhile: its EOF is read next round
                    self._queue.appendleft(job)
                    continue
                worker.job, worker.deadline = job, time.monotonic() + job.timeout_s
                worker.job_cpu_start = cpu_seconds(worker.process.pid)

    def _start_worker(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        command = [
            _python(),
            "-m",
            __name__,
            str(child_sock.fileno()),
            str(os.getpid()),
        ]
        try:
            process = subprocess.Popen(
                command,
                pass_fds=(child_sock.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_sock.close()
        self.num_started += 1
        now = time.monotonic()
        return _Worker(
            process, Connection(parent_sock.detach()), now, deadline=now + START_TIMEOUT_S
        )

    def _receive(self, worker: _Worker, finished: list) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            self._lost(worker, finished, "exited")
            return
        tag = message[0]
        if tag == "hello":
            with contextlib.suppress(OSError):  # it died: its EOF is read next
                worker.conn.send(self._tokenizer_json())
        elif tag == "ready":
            worker.ready = True
        elif worker.job is not None:
            job, worker.job = worker.job, None
            if tag == "ok":  # deserialized once the lock is released
                finished.append((job.future, _Compiled(message[1], message[2]), False))
            else:
                finished.append((job.future, CompileError(message[1]), True))

    @staticmethod
    def _extend(worker: _Worker, now: float) -> bool:
        """A job's timeout counts the CPU its worker spent on it, not the wall clock: a niced
        worker on a busy machine gets the CPU late, and a constraint that is cheap must not fail
        for that (wall-clock limits are the request's deadline and its client's to set). If
        the job is still under its budget, move its check to when it could first reach it."""
        if worker.job is None:
            return False
        used = worker.job_cpu_seconds()
        if used is None or used >= worker.job.timeout_s:
            return False
        worker.deadline = now + max(worker.job.timeout_s - used, _MIN_RECHECK_S)
        return True

    def _expire(self, worker: _Worker, finished: list) -> None:
        """Its job (or its start) ran past the deadline: kill and forget the worker."""
        job = worker.job
        if job is None:
            self._lost(worker, finished, f"did not start within {START_TIMEOUT_S:g} s")
            return
        worker.job = None
        code = self._kill(worker)
        self._workers.remove(worker)
        logger.warning(
            "grammar compile of a %s constraint stopped after %g CPU seconds (worker %d killed, code %s)",
            job.key[0],
            job.timeout_s,
            worker.process.pid,
            code,
        )
        finished.append(
            (job.future, CompileTimeout(f"not compiled within {job.timeout_s:g} s"), True)
        )

    def _lost(self, worker: _Worker, finished: list, why: str) -> None:
        """A worker died (or never started): fail its job, or, if it never became ready, the
        jobs waiting for one (a worker that cannot start would not serve them either)."""
        code = self._kill(worker)
        if worker in self._workers:
            self._workers.remove(worker)
        message = f"the grammar compile worker {why} (exit code {code})"
        logger.error("%s (pid %d)", message, worker.process.pid)
        if worker.job is not None:
            finished.append((worker.job.future, CompileError(message), True))
            worker.job = None
        elif not worker.ready and not any(w.ready for w in self._workers):
            while self._queue:
                finished.append((self._queue.popleft().future, CompileError(message), True))

    def _kill(self, worker: _Worker) -> int | None:
        """Kill (if still running) and reap the worker's process; its exit code."""
        with contextlib.suppress(OSError):
            worker.conn.close()
        if worker.process.poll() is None:
            with contextlib.suppress(OSError):
                worker.process.kill()
        try:
            return worker.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
            return None

    def _shutdown(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
            jobs = [w.job for w in workers if w.job is not None] + list(self._queue)
            self._queue.clear()
        for worker in workers:
            self._kill(worker)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(CompileError("the grammar compile workers are shut down"))
        for sock in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    def _tokenizer_json(self) -> str:
        if self._info_json is None:
            self._info_json = self.tokenizer_info.serialize_json()
        return self._info_json


def _deserialize(text: str, info: xgr.TokenizerInfo) -> xgr.CompiledGrammar:
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(text, info)


def _python() -> str:
    """The interpreter to run a worker with: this one, unless it is embedded (Triton's stub)."""
    executable = sys.executable or ""
    if os.path.basename(executable).startswith("python") and os.access(executable, os.X_OK):
        return executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (shutil.which(version), shutil.which("python3")):
        if candidate:
            return candidate
    return os.path.join(sys.prefix, "bin", "python3")


# --- pools shared by tokenizer --------------------------------------------------------------------

_OPEN: set[CompileWorkers] = set()
"""Pools not closed yet (closed at interpreter exit)."""
_SHARED: dict[tuple[str, int], tuple[CompileWorkers, int]] = {}
_SHARED_LOCK = threading.Lock()


def acquire_pool(tokenizer_info: xgr.TokenizerInfo, max_workers: int) -> CompileWorkers:
    """The process's pool for this tokenizer (and worker count), its users counted."""
    digest = hashlib.sha256(tokenizer_info.serialize_json().encode()).hexdigest()
    key = (digest, max_workers)
    with _SHARED_LOCK:
        pool, users = _SHARED.get(key, (None, 0))
        if pool is None or pool._closed:
            pool, users = CompileWorkers(tokenizer_info, max_workers), 0
        _SHARED[key] = (pool, users + 1)
        return pool


def release_pool(pool: CompileWorkers) -> None:
    """One user fewer; the last one closes the pool (its workers killed)."""
    with _SHARED_LOCK:
        for key, (shared, users) in list(_SHARED.items()):
            if shared is pool:
                if users > 1:
                    _SHARED[key] = (shared, users - 1)
                    return
                del _SHARED[key]
                break
    pool.close()


@atexit.register
def _close_all() -> None:
    for pool in list(_OPEN):
        pool.close(timeout=5)


# --- the worker side ------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux), and exit now if the
    parent is already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)


def worker_main(argv: list[str]) -> None:
    """A worker's life: handshake, then one compile per request until the socket closes."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    conn = Connection(fd)
    import xgrammar as xgr

    conn.send(("hello",))
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except EOFError:
        return
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return
        started = time.perf_counter()
        try:
            grammar = compile_constraint(compiler, key)
            seconds = time.perf_counter() - started
            reply = ("ok", grammar.serialize_json(), seconds)
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError, TypeError)
            reply = ("error", clean_error(exc))
        try:
            conn.send(reply)
        except OSError:
            return


if __name__ == "__main__":
    worker_main(sys.argv[1:])
