"""GGUF checkpoints (llama.cpp's format): `model` may name a `.gguf` file.

The file is read by transformers' GGUF support (`gguf_file=`: config and tokenizer from the
metadata, tensors through the `gguf` package, llama.cpp's rotary row order undone) and written
once, losslessly, in this engine's checkpoint form (config.json, model.safetensors in float32,
tokenizer.json) under `$XDG_CACHE_HOME/triton-llm/gguf/<digest of the file's path, size and
time>/`; the loader then reads that directory like any checkpoint.

Tensor types: F32, F16 and BF16 (float values, kept exactly). A quantized tensor (Q8_0, Q4_0,
K-quants) is refused at load, naming the tensor and its type, as is a file that is not a complete
GGUF: loading those as stored needs the WNA16 kernels' group formats, and dequantizing them at
load would hide that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from backend_lib.config import ConfigError

HF_OFFLINE_KWARGS = {"local_files_only": True, "trust_remote_code": False}
"""As backend_lib.checkpoint's (which imports this module): nothing downloaded, no remote code."""

SUFFIX = ".gguf"
FLOAT_TYPES = ("F32", "F16", "BF16")
DONE = ".complete"
"""Written last in a cache directory: one without it is an interrupted conversion."""


def is_gguf(path: Path) -> bool:
    return path.suffix == SUFFIX


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "triton-llm" / "gguf"


def materialize(path: Path, spec: str) -> Path:
    """The checkpoint directory of the GGUF file at `path` (converted on first use);
    ConfigError naming `model` (the setting `spec`) for a missing, incomplete or unsupported
    file."""
    if not path.is_file():
        raise ConfigError("model", spec, f"no GGUF file at {path}")
    check_tensor_types(path, spec)
    stat = path.stat()
    digest = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / digest[:32]
    if (out / DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _convert(path, staging)
        (staging / DONE).write_text(str(path))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def check_tensor_types(path: Path, spec: str) -> None:
    """ConfigError naming `model` when the file is not a readable GGUF or holds a tensor whose
    type this engine does not load (named, with its type)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        tensors = [(t.name, t.tensor_type.name, t.n_bytes, t.data.nbytes) for t in reader.tensors]
    except Exception as exc:  # a truncated or foreign file fails in the reader's parsing
        raise ConfigError("model", spec, f"not a complete GGUF file: {exc}") from None
    for name, kind, expected, found in tensors:
        if found != expected:
            raise ConfigError(
                "model", spec, f"GGUF tensor {name} is cut short ({found} of {expected} bytes)"
            )
        if kind not in FLOAT_TYPES:
            raise ConfigError(
                "model",
                spec,
                f"GGUF tensor {name} is {kind}: this engine loads {', '.join(FLOAT_TYPES)} "
                "tensors (quantized GGUF types are not supported yet)",
            )


def _convert(path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = {
        "pretrained_model_name_or_path": str(path.parent),
        "gguf_file": path.name,
        **HF_OFFLINE_KWARGS,
    }
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = model.config
    # transformers marks a GGUF-loaded model quantized and will not save it: its float values
    # are written here as they are, the tied lm_head once (as the embedding).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(**source).save_pretrained(out)
