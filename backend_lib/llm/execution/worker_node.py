"""A worker node of a multi-node model (`nnodes` > 1): runs that machine's ranks.

    python -m backend_lib.llm.execution.worker_node --model-dir /models/llm [--version 1]

with MASTER_ADDR (node 0's address), MASTER_PORT (its `master_port`) and NODE_RANK (this node's
index, 1..nnodes-1) in the environment, as a LeaderWorkerSet worker pod gets them (the chart maps
LWS_LEADER_ADDRESS and LWS_WORKER_INDEX onto them). The node reads the model's own config.pbtxt
(the same file node 0's tritonserver serves), so every rank builds the same engine; it then
starts one worker process per rank of this node (execution/worker.py) and waits. The first rank
to fail ends the others and the node, with that rank's exit code: the group is restarted whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import torch
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError, from_parameters, version_parameters
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.workers import check_devices, spawn_rank


def read_model_config(model_dir: Path) -> dict:
    """`model_dir`/config.pbtxt as the JSON form Triton hands a model (`args['model_config']`)."""
    message = text_format.Parse(
        (model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def node_config(model_dir: Path, version: str, environ: dict[str, str]) -> LLMConfig:
    """The model's LLMConfig with this node's place from the environment (ConfigError naming
    the field when one is missing or does not fit)."""
    config = from_parameters(LLMConfig, version_parameters(read_model_config(model_dir), version))
    try:
        node_rank, port = int(environ["NODE_RANK"]), int(environ["MASTER_PORT"])
        addr = environ["MASTER_ADDR"]
    except (KeyError, ValueError) as e:
        raise ConfigError(
            "node_rank",
            environ.get("NODE_RANK"),
            f"set NODE_RANK, MASTER_ADDR and MASTER_PORT ({e})",
        ) from e
    config = dataclasses.replace(config, node_rank=node_rank, master_addr=addr, master_port=port)
    config.validate()
    if config.nnodes == 1 or node_rank == 0:
        raise ConfigError("node_rank", node_rank, "a worker node has nnodes > 1 and node_rank >= 1")
    return config


def run_node(config: LLMConfig, checkpoint: Path, device: torch.device) -> int:
    """Start this node's ranks and wait; the exit code of the first that failed, else 0."""
    local = config.world_size // config.nnodes
    check_devices(device, local)
    first = config.node_rank * local
    procs = [
        spawn_rank(
            config, checkpoint, device, first + i, i, config.master_addr, config.master_port
        )[0]
        for i in range(local)
    ]
    signal.signal(signal.SIGTERM, lambda *_: _stop(procs, 143))
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            _stop(procs, failed[0])
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _stop(procs, code: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="the model's directory")
    parser.add_argument("--version", default="1")
    args = parser.parse_args(argv)
    config = node_config(args.model_dir, args.version, dict(os.environ))
    checkpoint = resolve_model_path(config.model, args.model_dir, config.gguf_file)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sys.exit(run_node(config, checkpoint, device))


if __name__ == "__main__":
    main()
