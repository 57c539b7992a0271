"""The other ranks (tensor-parallel ranks and pipeline stages), as worker processes of rank 0, and
rank 0's channel to them.

Rank 0 (the process that owns the engine: the Triton model's stub, or any `LLMEngine` with
`LLMConfig.world_size` > 1 and no process group yet) starts one process per other rank
(`python -m backend_lib.llm.execution.worker`), each with the environment of torch.distributed's
env rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) and its share of the
CPU cores (OMP_NUM_THREADS) or its own GPU (cuda:LOCAL_RANK). Every rank builds the same
`ModelRunner`; the workers then replay each `StepMessage` rank 0 broadcasts (a pickled object
over a gloo group: a step's host data, not its tensors) until a None says stop.

Faults: a worker that exits is seen before the next broadcast (`WorkerDied`, naming the rank,
its exit code and the end of its log), which fails that step's requests; a worker that fails to
start fails rank 0's load the same way; `close` (the engine's) stops them, and a worker whose
parent dies is killed by the kernel (PR_SET_PDEATHSIG), so no worker outlives its model.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from backend_lib.config import ConfigError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.step_input import BlockMoves, StepMessage

WORKER_MODULE = "backend_lib.llm.execution.worker"
"""What each worker process runs (`python -m`)."""
JOINED_KEY = "llm-worker-joined-"
"""A worker sets `<JOINED_KEY><rank>` in the group's store once it has started."""
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
"""How long the ranks wait for each other at start (a large model's workers load it first)."""
LOG_TAIL = 2000
"""Characters of a dead worker's log quoted in its error."""


_driving = False
"""Whether a WorkerGroup of this process holds torch.distributed's default group."""


def driving() -> bool:
    """Whether this process is rank 0 of a group of ranks it started."""
    return _driving


class WorkerDied(RuntimeError):
    """A worker process (another rank) exited."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(size: int) -> int:
    """This machine's cores shared evenly among the ranks on it (at least one each)."""
    return max(1, (os.cpu_count() or 1) // size)


def check_devices(device: torch.device, ranks_here: int) -> None:
    """ConfigError naming tensor_parallel_size when this node has fewer GPUs than its ranks
    (tensor_parallel_size x pipeline_parallel_size / nnodes)."""
    if device.type == "cuda" and torch.cuda.device_count() < ranks_here:
        raise ConfigError(
            "tensor_parallel_size",
            ranks_here,
            f"more ranks on this node than GPUs: it has {torch.cuda.device_count()}",
        )


def spawn_rank(
    config: LLMConfig,
    checkpoint: Path,
    device: torch.device,
    rank: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
) -> tuple[subprocess.Popen, Path]:
    """Start rank `rank` (the `local_rank`-th on this node) as a worker process with
    torch.distributed's env rendezvous variables; returns it and its log file."""
    log = Path(tempfile.mkstemp(prefix=f"llm-rank{rank}-", suffix=".log")[1])
    command = [
        sys.executable,
        "-m",
        WORKER_MODULE,
        "--config",
        json.dumps(asdict(config)),
        "--checkpoint",
        str(Path(checkpoint).resolve()),
        "--device",
        device.type,
    ]
    ranks_here = config.world_size // config.nnodes
    env = {
        **os.environ,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(config.world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "OMP_NUM_THREADS": str(threads_per_rank(ranks_here)),
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


class WorkerGroup:
    """Rank 0's handle on ranks 1..size-1: their processes and the step channel."""

    def __init__(self, config: LLMConfig, checkpoint: Path, device: torch.device):
        global _driving
        if _driving:
            raise ConfigError(
                "tensor_parallel_size",
                config.tensor_parallel_size,
                "another tensor-parallel engine of this process drives its workers (one per "
                "process: torch.distributed has one default group)",
            )
        size = config.world_size
        local = size // config.nnodes
        check_devices(device, local)
        self.size, self.tp_size = size, config.tensor_parallel_size
        port = config.master_port or _free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for rank in range(1, local):  # this node's other ranks; other nodes start their own
            proc, log = spawn_rank(config, checkpoint, device, rank, rank, "127.0.0.1", port)
            self.procs.append(proc)
            self.logs.append(log)
        try:
            store = self._rendezvous(port)
            dist.init_process_group(
                backend_for(device),
                store=store,
                rank=0,
                world_size=size,
                timeout=RENDEZVOUS_TIMEOUT,
            )
            self.channel = channel_group(device)
            _driving = True
        except Exception as exc:
            died = self.died()
            self._kill()
            self._leave()
            if isinstance(exc, WorkerDied):
                raise
            raise died or WorkerDied(f"tensor-parallel rendezvous failed: {exc}") from exc

    def _rendezvous(self, port: int) -> dist.TCPStore:
        """The group's store, once every worker has joined it; WorkerDied as soon as one exits
        first (e.g. it failed to import or start), instead of waiting out the timeout."""
        # Listening on every interface: worker nodes (nnodes > 1) join from other machines.
        store = dist.TCPStore(
            "0.0.0.0",
            port,
            self.size,
            is_master=True,
            timeout=RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
        )
        joined = [f"{JOINED_KEY}{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while not store.check(joined):
            died = self.died()
            if died is not None:
                raise died
            if time.monotonic() > deadline:
                raise WorkerDied(
                    f"tensor-parallel workers did not join within {RENDEZVOUS_TIMEOUT}"
                )
            time.sleep(0.05)
        return store

    def send(self, message: StepMessage | None) -> None:
        """Broadcast `message` (None: stop) to every worker; WorkerDied if one has exited."""
        died = self.died()
        if died is not None:
            raise died
        try:
            dist.broadcast_object_list([message], src=0, group=self.channel)
        except RuntimeError as exc:  # a peer gone mid-broadcast
            raise self.died() or exc from exc

    def check_reads(self, reads: list[tuple[bytes, int]], failed: set) -> set:
        """Ask every worker which of these disk reads it could not do (each reads its own
        shard's file); the union with rank 0's own `failed`."""
        self.send(StepMessage(BlockMoves(), None, read_check=reads))
        gathered: list = [None] * dist.get_world_size(self.channel)
        dist.gather_object(failed, gathered, dst=0, group=self.channel)
        return set().union(*gathered)

    def failed_start(self) -> WorkerDied | None:
        """The error to report when rank 0's load failed after the rendezvous: a worker's own
        failure (e.g. out of memory) when one exited, None otherwise. Stops the workers."""
        died = self.died(wait=5.0)
        self._kill()
        self._leave()
        return died

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (asked first, then killed) and leave the process group."""
        if self.died() is None:
            with contextlib.suppress(Exception):  # a worker gone meanwhile: killed below
                self.send(None)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._leave()

    def _leave(self) -> None:
        """After the workers ended: leave the process group, drop their logs."""
        global _driving
        if dist.is_initialized():
            dist.destroy_process_group()
        _driving = False
        for log in self.logs:
            log.unlink(missing_ok=True)

    def died(self, wait: float = 0.0) -> WorkerDied | None:
        """The error naming the first of this node's workers that has exited (waiting up to
        `wait` seconds for one to), None while all run."""
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True), start=1):
            try:
                code = proc.wait(timeout=wait) if wait else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                tail = log.read_text(errors="replace")[-LOG_TAIL:] if log.exists() else ""
                place = f"tensor-parallel rank {rank % self.tp_size}"
                if self.size > self.tp_size:
                    place += f" of pipeline stage {rank // self.tp_size}"
                return WorkerDied(
                    f"rank {rank} ({place}, pid {proc.pid}) exited with code {code}"
                    + (f":\n{tail}" if tail else "")
                )
        return None

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def channel_group(device: torch.device):
    """The group steps are broadcast over: gloo, which sends pickled objects from host memory
    (the default group itself on CPU; a gloo group beside NCCL on CUDA). Every rank calls this
    once, in the same order (a collective)."""
    if backend_for(device) == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")
