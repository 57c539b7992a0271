"""A tensor-parallel worker (ranks 1..N-1): `python -m backend_lib.llm.execution.worker`.

Started by rank 0's `WorkerGroup` (execution/workers.py) with torch.distributed's env rendezvous
variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK): joins the group, builds the
same ModelRunner as rank 0 on its share of the model, then replays every step rank 0 broadcasts
until told to stop. It exits with its parent (PR_SET_PDEATHSIG) or when the group breaks.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.model_runner import ModelRunner
from backend_lib.llm.execution.workers import (
    JOINED_KEY,
    RENDEZVOUS_TIMEOUT,
    backend_for,
    channel_group,
)

log = logging.getLogger("llm-worker")


def _die_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux), so none is orphaned."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _bind_cores(local_rank: int, threads: int) -> None:
    """Pin this rank to its own `threads` cores of the allowed set (rank r: the r-th slice), so
    the ranks of one machine do not contend for the same cores."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[local_rank * threads : (local_rank + 1) * threads]
    if mine:
        os.sched_setaffinity(0, mine)


def serve(config: LLMConfig, checkpoint: str, device: torch.device, timeout: timedelta) -> None:
    """Join the group, build this rank's runner, replay rank 0's steps until a None."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, False, timeout=timeout
    )
    store.set(f"{JOINED_KEY}{rank}", "1")
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=size, timeout=timeout
    )
    try:
        channel = channel_group(device)
        runner = ModelRunner(config, device, checkpoint)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=channel)
            if box[0] is None:
                break
            if box[0].read_check is not None:  # rank 0 asks about this rank's disk reads
                failed = runner.unread(box[0].read_check)
                dist.gather_object(failed, None, dst=0, group=channel)
                continue
            runner.run_step(box[0])
        runner.close()  # its offload tier's queued disk writes finish before the process ends
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the LLMConfig as JSON")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(message)s")
    config = LLMConfig(**json.loads(args.config))
    config.validate()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
        _bind_cores(local_rank, threads)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
    serve(config, args.checkpoint, device, RENDEZVOUS_TIMEOUT)


if __name__ == "__main__":
    main()
    # Ended cleanly (the runner closed, the group left): skip the interpreter's teardown of torch
    # and the rest (~1 s of CPU that rank 0's close would wait for); only the log needs flushing.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
