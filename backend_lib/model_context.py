"""What Triton tells a Python-backend model at `initialize`, in typed form."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend_lib.config import version_parameters
from backend_lib.device import select_device
from backend_lib.metrics import MetricsSink, TritonMetrics


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

    def metrics(self, pb_utils: Any) -> MetricsSink:
        """Metrics exported on tritonserver's metrics port, labelled with this model and version."""
        return TritonMetrics(pb_utils, {"model": self.name, "version": self.version})
