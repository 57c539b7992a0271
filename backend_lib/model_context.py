"""What Triton tells a Python-backend model at `initialize`, in typed form, and what its
`finalize` does last."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend_lib.config import version_parameters
from backend_lib.device import select_device
from backend_lib.metrics import TritonMetrics


@dataclass
class ModelContext:
    """Name, version, directory, device and config parameters of one model instance."""

    name: str
    version: str
    model_dir: Path
    device: torch.device
    parameters: dict[str, str]
    model_config: dict[str, Any]
    instance_kind: str = "CPU"
    """Triton's instance kind, without the KIND_ prefix: CPU, GPU or MODEL."""

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ModelContext:
        model_config = json.loads(args["model_config"])
        version = str(args["model_version"])
        parameters = version_parameters(model_config, version)
        return cls(
            name=str(args["model_name"]),
            version=version,
            # `model_repository` is the model's own directory (the parent of its version folders).
            model_dir=Path(args["model_repository"]),
            device=select_device(args),
            parameters=parameters,
            model_config=model_config,
            instance_kind=str(args.get("model_instance_kind", "CPU")).upper().removeprefix("KIND_"),
        )

    def metrics(self, pb_utils: Any) -> TritonMetrics:
        """Metrics exported on tritonserver's metrics port, labelled with this model and version."""
        return TritonMetrics(pb_utils, {"model": self.name, "version": self.version})


def server_model_control_mode(server_pid: int | None = None) -> str:
    """The `--model-control-mode` of the tritonserver hosting this stub (the stub's parent
    process; `server_pid` to ask about another): none, poll or explicit ("none" when unset, as
    the server's default). Read from the server's own command line, the one place it is set."""
    pid = os.getppid() if server_pid is None else server_pid
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "none"
    mode = "none"
    for index, arg in enumerate(args):
        if arg.startswith("--model-control-mode="):
            mode = arg.partition("=")[2]
        elif arg == "--model-control-mode" and index + 1 < len(args):
            mode = args[index + 1]
    return mode.lower()


def before_stub_exit(metrics: TritonMetrics) -> None:
    """The last step of a model's `finalize`: its stub process exits next.

    - The pb_utils metrics are kept alive past the interpreter's exit (`keep_until_exit`).
    - The garbage collector is frozen, for two reasons. The interpreter's exit then skips a full
      collection over the engine's objects (1.4 s of a 2-core CPU with the default llm loaded;
      0.3 s frozen), all of it memory the process is about to give back. And no pb_utils object
      left in a reference cycle (a request held by a stored traceback) is destroyed after the
      stub has begun to exit, which crashes it as the metrics would.
    """
    metrics.keep_until_exit()
    gc.freeze()
