"""Start and stop a real `tritonserver` on free local ports (tests and benchmarks).

Uses the `tritonserver` next to this interpreter (the venv launcher installed by `make setup`), which runs a
system tritonserver when one exists and the binary of the `nvidia-pytriton` wheel otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tooling.child_process import die_with_parent

SERVER_ARGS = ("--disable-auto-complete-config",)
"""Flags every tritonserver of this project carries (`make serve`, tests, benchmarks, the images
and the Helm chart). Without it the Python backend starts one more stub process per model, which
imports model.py only to ask for a config completion that no model here implements (every
config.pbtxt is whole): twice the imports, and the default repository took 62.6 s to load
instead of 28.5 s (AMD EPYC, 2 cores)."""


def free_ports(count: int) -> list[int]:
    """`count` distinct free local ports.

    All sockets stay bound until every port is chosen: ports picked one at a time may repeat (the kernel
    can hand a just-closed ephemeral port out again), and a server given the same port twice will not start.
    """
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


# What tritonserver logs when one of its ports is taken (by another process since the ports were chosen).
PORT_IN_USE_MARKERS = ("already in use", "cannot listen")
UPSTREAM_LOAD_ABORT = "boost::interprocess::lock_exception"
"""Triton 2.51's Python backend now and then aborts the whole server while several stubs start
at once on a busy machine (triton-inference-server/server#8882, open upstream): a start that
dies of it is tried again."""


def http_status(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> int | None:
    """The HTTP status of a request to `url`, or None when nothing answers."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def tritonserver_command() -> str:
    """The launcher beside this interpreter, else whatever `tritonserver` is on PATH."""
    beside = Path(sys.executable).parent / "tritonserver"
    if beside.exists():
        return str(beside)
    found = shutil.which("tritonserver")
    if found is None:
        raise FileNotFoundError("no tritonserver found: run `make setup` first")
    return found


_FALSE = ("false", "0", "off", "no")


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in `args` (the last one; None: absent)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
    return None if value is None else value.lower()


class TritonServer:
    """A tritonserver process serving `repository` on free ports; use as a context manager."""

    def __init__(
        self,
        repository: str | Path,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
    ):
        self.repository = Path(repository)
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.startup_timeout = startup_timeout
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        handle, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        self._log = os.fdopen(handle, "wb")
        self.log_path = Path(name)
        self._log_start = 0
        """Where the current start's lines begin in the log (characters)."""
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        return [
            tritonserver_command(),
            f"--model-repository={self.repository}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--log-verbose=0",
            *SERVER_ARGS,
            *self.extra_args,
        ]

    def start(self, attempts: int = 3) -> TritonServer:
        """Start and wait until live; on a port taken meanwhile by another process, retry on new
        ports; after the upstream abort at load (UPSTREAM_LOAD_ABORT), retry as it is."""
        for attempt in range(attempts):
            self._spawn()
            try:
                self._wait_live()
                return self
            except RuntimeError:
                tail = self.log_tail(20)
                if attempt + 1 == attempts:
                    raise
                if any(marker in tail for marker in PORT_IN_USE_MARKERS):
                    self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
                elif UPSTREAM_LOAD_ABORT in tail:
                    print(f"tritonserver aborted at load ({UPSTREAM_LOAD_ABORT}): starting again")
                else:
                    raise
        return self

    def _spawn(self) -> None:
        self._log.flush()
        self._log_start = len(self.log_text())  # this start's lines come after
        env = {**os.environ, **self.env}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # never outlives its parent (child_process.py)
        )

    def _wait_live(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if (
                self._serves_its_ports()
                and http_status(f"http://{self.http_url}/v2/health/live") == 200
            ):
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"tritonserver not live after {self.startup_timeout}s:\n{self.log_tail()}"
        )

    def _serves_its_ports(self) -> bool:
        """Whether this start's own log says it serves its HTTP (and metrics) port: the port may
        answer for another server that took it between `free_ports` and our bind. True when the
        arguments keep those lines out of the log (`--log-info=false`, `--log-file`)."""
        if _option(self.extra_args, "log-info") in _FALSE or _option(self.extra_args, "log-file"):
            return True
        log = self.log_text()[self._log_start :]
        wanted = [("Started HTTPService at ", self.http_port)]
        if _option(self.extra_args, "allow-metrics") not in _FALSE:
            wanted.append(("Started Metrics Service at ", self.metrics_port))
        return all(re.search(rf"{prefix}\S+:{port}\b", log) for prefix, port in wanted)

    def is_ready(self) -> bool:
        return http_status(f"http://{self.http_url}/v2/health/ready") == 200

    def is_alive(self) -> bool:
        return (
            self.process is not None
            and self.process.poll() is None
            and http_status(f"http://{self.http_url}/v2/health/live") == 200
        )

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 200) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            self._log.close()
            return
        # SIGTERM to the server alone, as a container runtime sends it: the server unloads each
        # model (its stub's finalize) and ends the stubs. Signalled too, the stubs would start
        # their own exit beside the unload the server asks of them, and the server would wait
        # out its exit timeout for a model whose stub no longer answers.
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # The server runs in its own session: whatever of it is left (a stub, a worker) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
