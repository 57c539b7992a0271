"""Pre-quantized test checkpoints: the Shakespeare model written by compressed-tensors itself in
each preset of tooling/quantized_checkpoints.py, built once per process."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

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
