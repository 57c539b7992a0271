"""GGUF checkpoints (llama.cpp's format): `model` may name a `.gguf` file.

The file is read by transformers' GGUF support (`gguf_file=`: config and tokenizer from the
metadata, tensors through the `gguf` package, llama.cpp's rotary row order undone) and written
once, losslessly, in this engine's checkpoint form (config.json, model.safetensors in float32,
tokenizer.json) under `$XDG_CACHE_HOME/triton-llm/gguf/<digest of the file's path, size and
time>/`; the loader then reads that directory like any checkpoint.

Tensor types: F32, F16 and BF16 (float values, kept exactly), and for the projections Q8_0 and
Q4_0, loaded as stored: both are symmetric integers (8 bits, and 4 bits around 8) with one float16
scale per 32 inputs, which is a compressed-tensors pack-quantized W8A16 / W4A16 group-32 layer
(written with compressed-tensors' own packing; its weights dequantize exactly as
`gguf.quants.dequantize` does, and run on the WNA16 kernels). Any other tensor type (K-quants, a
quantized embedding or norm) is refused at load, naming the tensor and its type, as is a file that
is not a complete GGUF.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from backend_lib.config import ConfigError

SUFFIX = ".gguf"
FLOAT_TYPES = ("F32", "F16", "BF16")
PACKED_TYPES = {"Q8_0": 8, "Q4_0": 4}
"""Quantized types loaded as stored (bits per weight); their block: a float16 scale, 32 values."""
GROUP = 32
PROJECTIONS = tuple(
    f"{name}.weight"
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
)
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
        projection = name.startswith("blk.") and name.endswith(PROJECTIONS)
        if kind not in FLOAT_TYPES and not (kind in PACKED_TYPES and projection):
            raise ConfigError(
                "model",
                spec,
                f"GGUF tensor {name} is {kind}: this engine loads {', '.join(FLOAT_TYPES)} "
                f"tensors, and {', '.join(PACKED_TYPES)} for the layers' projections",
            )


def _convert(path: Path, out: Path) -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Here: backend_lib.checkpoint imports this module.
    from backend_lib.checkpoint import HF_OFFLINE_KWARGS

    source = {
        "pretrained_model_name_or_path": str(path.parent),
        "gguf_file": path.name,
        **HF_OFFLINE_KWARGS,
    }
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    packed = _packed_projections(path, model)
    config = model.config
    # transformers marks a GGUF-loaded model quantized and will not save it: its float values
    # are written here as they are, the tied lm_head once (as the embedding).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for module, (bits, values, scales) in packed.items():
        del state[f"{module}.weight"]
        state[f"{module}.weight_packed"] = pack_to_int32(values, bits)
        state[f"{module}.weight_scale"] = scales
        state[f"{module}.weight_shape"] = torch.tensor(values.shape, dtype=torch.int64)
    save_file(state, str(out / "model.safetensors"))
    config.save_pretrained(out)
    if packed:
        _write_quantization_config(out, packed)
    AutoTokenizer.from_pretrained(**source).save_pretrained(out)


def _packed_projections(path: Path, model) -> dict:
    """Module name -> (bits, int8 values [N, K], float32 scales [N, K / 32]) of each Q8_0 or Q4_0
    projection, rows in the model's order (llama.cpp's rotary row order undone as transformers
    undoes it for the float values)."""
    import gguf
    import numpy as np
    import torch
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = gguf.GGUFReader(str(path))
    quantized = [t for t in reader.tensors if t.tensor_type.name in PACKED_TYPES]
    if not quantized:
        return {}
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    packed = {}
    for tensor in quantized:
        bits = PACKED_TYPES[tensor.tensor_type.name]
        values, scales = _blocks(np.asarray(tensor.data), bits)
        rows = np.arange(values.shape[0], dtype=np.float32)[:, None]
        order = processor.process(
            weights=rows, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        index = torch.from_numpy(order.weights[:, 0].astype(np.int64))
        module = names[order.name].removesuffix(".weight")
        # float32 scales (exact from float16): the product is then gguf's own, scale * value in
        # float32, wherever it is dequantized.
        scales = torch.from_numpy(scales).to(torch.float32)
        packed[module] = (bits, torch.from_numpy(values)[index], scales[index])
    return packed


def _blocks(data, bits: int):
    """A Q8_0 or Q4_0 tensor's raw blocks [N, blocks * block bytes] -> signed values int8 [N, K]
    and float16 scales [N, K / 32] (gguf's layouts: Q8_0 = scale, 32 int8; Q4_0 = scale, 16 bytes
    whose low nibbles are values 0-15 and high nibbles 16-31, each stored + 8)."""
    import numpy as np

    block_bytes = 2 + GROUP * bits // 8
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, block_bytes)
    scales = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
    payload = blocks[:, :, 2:]
    if bits == 8:
        values = payload.view(np.int8)
    else:
        low = (payload & 0x0F).astype(np.int8) - 8
        high = (payload >> 4).astype(np.int8) - 8
        values = np.concatenate([low, high], axis=-1)
    return values.reshape(rows, -1).copy(), scales.copy()


def _write_quantization_config(out: Path, packed: dict) -> None:
    """config.json's compressed-tensors `quantization_config`: one pack-quantized group per bit
    width, targeting its modules by name; every other linear (the lm_head) stays float."""
    import json

    groups = {}
    for bits in sorted({b for b, _, _ in packed.values()}):
        groups[f"group_{bits}"] = {
            "targets": sorted(m for m, (b, _, _) in packed.items() if b == bits),
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP,
                "dynamic": False,
            },
            "format": "pack-quantized",
        }
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": [],
    }
    config_path.write_text(json.dumps(config, indent=2))
