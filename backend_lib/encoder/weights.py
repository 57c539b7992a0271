"""Tensors of a safetensors checkpoint (single file or sharded), by their names.

Only safetensors is read: it holds plain tensors, so loading a checkpoint cannot run code. Which
files hold the weights is `backend_lib.checkpoint.safetensors_files`'s call.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from backend_lib.checkpoint import safetensors_files
from backend_lib.config import ConfigError

# Checkpoints written by older transformers name LayerNorm parameters gamma/beta.
_LEGACY_SUFFIXES = {".weight": ".gamma", ".bias": ".beta"}


def _tensor_files(model_dir: Path, spec: str) -> dict[str, Path]:
    """Map each tensor name to the file that holds it (only the files' headers are read)."""
    names: dict[str, Path] = {}
    for file in safetensors_files(model_dir, spec):
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


class CheckpointWeights:
    """Reads named tensors, converted to one dtype and device.

    `prefix` is prepended to every requested name; it is found from the word-embedding
    tensor, so a bare `BertModel` save ("embeddings...") and a task model's save
    ("bert.embeddings...", "roberta.embeddings...") both load.
    """

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, spec: str):
        self.dtype, self.device, self.spec = dtype, device, spec
        self._files = _tensor_files(model_dir, spec)
        anchor = "embeddings.word_embeddings.weight"
        hits = sorted((n for n in self._files if n.endswith(anchor)), key=len)
        if not hits:
            raise ConfigError("model", spec, f"no '{anchor}' tensor in the safetensors weights")
        self.prefix = hits[0][: -len(anchor)]

    def get(self, name: str, prefixed: bool = True) -> torch.Tensor:
        """The tensor `name`; `prefixed=False` for heads stored outside the base model."""
        key = self._resolve(name, prefixed)
        if key is None:
            raise ConfigError("model", self.spec, f"tensor '{name}' missing from the weights")
        with safe_open(str(self._files[key]), framework="pt") as handle:
            tensor = handle.get_tensor(key)
        return tensor.to(device=self.device, dtype=self.dtype)

    def has(self, name: str, prefixed: bool = True) -> bool:
        """Whether the tensor `name` is stored (a tied head's weight may not be)."""
        return self._resolve(name, prefixed) is not None

    def _resolve(self, name: str, prefixed: bool) -> str | None:
        key = self.prefix + name if prefixed else name
        if key in self._files:
            return key
        for new, old in _LEGACY_SUFFIXES.items():
            if key.endswith(new) and key[: -len(new)] + old in self._files:
                return key[: -len(new)] + old
        return None
