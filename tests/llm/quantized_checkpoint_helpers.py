"""Pre-quantized test checkpoints: the Shakespeare model written by compressed-tensors itself in
each preset of tooling/quantized_checkpoints.py, built once per process; what the checkpoint-format
tests share (a model loaded as stored, editing a copy into a bad checkpoint)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from backend_lib.llm.execution.loader import load_checkpoint_weights, read_checkpoint_info
from kernels import kernel_ops
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling import quantized_checkpoints

_BUILT: dict[str, Path] = {}

PACKED_PRESETS = ("W4A16_G128", "W4A16_G64_ASYM", "W4A16_CHANNEL", "W8A16_CHANNEL")
"""Weight-only int presets (pack-quantized), which transformers decompresses and runs on CPU."""
PRESETS = (*PACKED_PRESETS, "W8A8_DYNAMIC", "FP8_DYNAMIC", "FP8_DYNAMIC_PER_TENSOR")


def quantized_shakespeare(preset: str) -> Path:
    """The Shakespeare model quantized by compressed-tensors in `preset` (a tooling preset name)."""
    if preset not in _BUILT:
        out = Path(tempfile.mkdtemp(prefix=f"shakespeare-{preset}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        scheme = quantized_checkpoints.PRESETS[preset]
        _BUILT[preset] = quantized_checkpoints.write_compressed_tensors_checkpoint(
            SHAKESPEARE, out, scheme
        )
    return _BUILT[preset]


def copy_checkpoint(source: Path, dest: Path) -> Path:
    """A writable copy of checkpoint `source` (for corrupting it)."""
    shutil.copytree(source, dest)
    return dest


def staged_model(checkpoint: Path) -> torch.nn.Module:
    """The checkpoint's model on CPU in float32, loaded as stored (its quantized layers still
    `StagingLinear`s)."""
    info = read_checkpoint_info(checkpoint)
    return load_checkpoint_weights(info, torch.device("cpu"), torch.float32, kernel_ops("torch"))


def edit_quantization_config(checkpoint: Path, edit) -> None:
    """Apply `edit` to config.json's `quantization_config` in place."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def edit_tensors(checkpoint: Path, edit) -> None:
    """Apply `edit` to model.safetensors' {name: tensor} and save it back."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
