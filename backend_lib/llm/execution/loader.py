"""Load a local Hugging Face checkpoint directory into one of the registered model classes.

Only local files, only safetensors (pickle `.bin` weights are refused: unpickling can run
code), never remote code. Tensors go straight from the file to the target device, then are
cast into the preallocated parameters one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backend_lib.config import ConfigError
from backend_lib.linear import pack_linear_layers
from backend_lib.llm.execution.models import MODEL_REGISTRY, supported_architectures
from kernels import KernelOps

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError("model", str(model_dir), "no config.json in the checkpoint directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def model_class_for(cfg: dict[str, Any], model_dir: str | Path = "") -> type[torch.nn.Module]:
    """The registered class for `architectures[0]`; a clear error for anything else."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in MODEL_REGISTRY:
        raise ConfigError(
            "model",
            str(model_dir),
            f"unsupported architecture {arch!r}; supported: {', '.join(supported_architectures())}",
        )
    if cfg.get("quantization_config"):
        raise ConfigError("model", str(model_dir), "quantized checkpoints are not supported")
    return MODEL_REGISTRY[arch]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """Weight files: the shards named by the index, or the single `model.safetensors`."""
    root = Path(model_dir)
    index = root / _INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / _SINGLE_FILE).is_file():
        return [root / _SINGLE_FILE]
    if any(root.glob("*.bin")) or any(root.glob("*.pt")) or any(root.glob("*.pth")):
        raise ConfigError(
            "model",
            str(model_dir),
            "only safetensors weights are loaded; pickle (.bin/.pt) checkpoints are "
            "refused because unpickling can execute code: convert them to safetensors",
        )
    raise ConfigError(
        "model", str(model_dir), f"no {_SINGLE_FILE} or {_INDEX_FILE} in the checkpoint directory"
    )


def iter_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, each loaded directly onto `device`."""
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    max_position: int | None = None,
    pack_linear_weights: bool = True,
) -> torch.nn.Module:
    """Build the checkpoint's model on `device` in `dtype` and load its weights.

    `max_position` sizes the rotary table (default: the checkpoint's max_position_embeddings).
    On CPU the projections' weights are then pre-packed for oneDNN (`backend_lib.linear`) unless
    `pack_linear_weights` is False.
    """
    cfg = load_hf_config(model_dir)
    model_cls = model_class_for(cfg, model_dir)
    try:
        args = model_cls.args_from_config(cfg)
    except (KeyError, ValueError) as e:
        raise ConfigError("model", str(model_dir), f"bad config.json: {e}") from e
    files = safetensors_files(model_dir)
    # Parameters start on the meta device (no memory, no random init), then get real storage.
    with torch.device("meta"):
        model = model_cls(args, ops, device, max_position)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    model.load_weights(iter_safetensors(files, device))
    if pack_linear_weights:
        pack_linear_layers(model)
    return model.eval()
