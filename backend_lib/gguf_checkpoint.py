"""GGUF checkpoints (llama.cpp's format): `model` may name a `.gguf` file.

The file is read by transformers' GGUF support (`gguf_file=`: config and tokenizer from the
metadata, tensors through the `gguf` package, llama.cpp's rotary row order undone) and written
once, losslessly, in this engine's checkpoint form (config.json, model.safetensors, tokenizer.json)
under `$XDG_CACHE_HOME/triton-llm/gguf/<digest of the converter's version, the file's path, size and time>/`; the loader then
reads that directory like any checkpoint.

Architectures: those both transformers' GGUF reader and this engine know; tested are llama.cpp's
llama, qwen2, qwen3, gemma2, gemma3 (text) and phi3 files (tests/llm/engine/test_gguf.py).

Tensor types: F32, F16 and BF16 (float values, kept exactly), and Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K and Q6_K. The layers' projections in those types load as stored: their blocks are decoded into the
WNA16 layers' values, scales, zero points and float minimums (backend_lib/gguf_quants.py) and
saved as a `quant_method: gguf` checkpoint (checkpoint_quantization/gguf_blocks.py), whose weights
dequantize bit for bit as `gguf.quants.dequantize` does and run on the WNA16 kernels. Projections
the engine fuses into one (q/k/v, gate/up) but stored in different types are brought to one layout
without changing a value; Phi-3's, stored fused (attn_qkv, and ffn_up holding gate and up), load
whole into the fused layers; an untied output head (llama-quantize's Q6_K) loads as stored too.
Other tensors in those types (the token embedding) load dequantized, exactly. Any other type is refused at load, naming the tensor and its type, as is a file that is
not a complete GGUF.
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
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""Quantized types loaded as stored in the projections (backend_lib/gguf_quants.py)."""
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
"""Projections the engine fuses into one (Phi-3's checkpoints, and its GGUF files, hold them fused
already): they share one layout."""
PROJECTIONS = (
    "ATTN_Q",
    "ATTN_K",
    "ATTN_V",
    "ATTN_QKV",
    "ATTN_OUT",
    "FFN_GATE",
    "FFN_UP",
    "FFN_DOWN",
    "OUTPUT",
)
"""The projections that load as stored, as gguf-py's tensor-name map types them
(`gguf.MODEL_TENSOR`): the layers' (Phi-3's fused attn_qkv, and its ffn_up holding gate and up,
among them) and the output head (absent where it is tied to the token embedding)."""
CONVERTER_VERSION = 4
"""Part of a conversion's cache key: a file converted by an older converter is converted again."""
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
    key = f"{CONVERTER_VERSION}:{path}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()
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
        if kind not in FLOAT_TYPES + PACKED_TYPES:
            raise ConfigError(
                "model",
                spec,
                f"GGUF tensor {name} is {kind}: this engine loads "
                f"{', '.join(FLOAT_TYPES + PACKED_TYPES)} tensors",
            )


def _convert(path: Path, out: Path) -> None:
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Here: backend_lib.checkpoint imports this module.
    from backend_lib.checkpoint import HF_OFFLINE_KWARGS
    from kernels.wna16_linear import pack_wna16

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
        packed.pop("lm_head", None)  # the head is the embedding: float, as transformers ties it
    for module, weight in packed.items():
        del state[f"{module}.weight"]
        values = torch.from_numpy(weight.values)
        state[f"{module}.weight_packed"] = pack_wna16(values, weight.bits)
        state[f"{module}.weight_scale"] = torch.from_numpy(weight.scales)
        state[f"{module}.weight_zero"] = torch.from_numpy(weight.zeros)
        if weight.mins is not None:
            state[f"{module}.weight_min"] = torch.from_numpy(weight.mins)
    save_file(state, str(out / "model.safetensors"))
    config.save_pretrained(out)
    if packed:
        _write_quantization_config(out, packed)
    AutoTokenizer.from_pretrained(**source).save_pretrained(out)
    # Its tokenizer.json is the whole tokenizer; an architecture's own class may not reload what
    # it saved (GemmaTokenizer without an unknown token), so the generic fast class reads it.
    tokenizer_config = out / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(fields, indent=2))


def _packed_projections(path: Path, model) -> dict:
    """Module name -> `DecodedWeight` of each projection stored in a PACKED_TYPES type, rows in
    the model's order (llama.cpp's rotary row order undone as transformers undoes it for the
    float values), fused projections in one layout."""
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from backend_lib import gguf_quants

    reader = gguf.GGUFReader(str(path))
    quantized = _quantized_projections(reader)
    if not quantized:
        return {}
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    packed = {}
    for tensor in quantized:
        weight = gguf_quants.decode(tensor.tensor_type.name, np.asarray(tensor.data))
        rows = np.arange(weight.values.shape[0], dtype=np.float32)[:, None]
        order = processor.process(
            weights=rows, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        index = order.weights[:, 0].astype(np.int64)
        module = names[order.name].removesuffix(".weight")
        packed[module] = _rows(weight, index)
    modules = [n.removesuffix(".weight") for n in model.state_dict() if n.endswith(".weight")]
    return _one_layout_per_fusion(packed, modules)


def _quantized_projections(reader) -> list:
    """The tensors of `reader` that are a layer's projection weight (PROJECTIONS, by gguf-py's
    tensor-name map of the file's architecture) in a PACKED_TYPES type."""
    import gguf

    architecture = reader.fields["general.architecture"].contents()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture), None)
    if arch is None:  # transformers, which read the file first, knows no more architectures
        return []
    blocks = reader.fields[f"{architecture}.block_count"].contents()
    names = gguf.get_tensor_name_map(arch, blocks)
    kinds = {gguf.MODEL_TENSOR[p] for p in PROJECTIONS}
    return [
        t
        for t in reader.tensors
        if t.tensor_type.name in PACKED_TYPES
        and t.name.endswith(".weight")
        and names.get_type(t.name.removesuffix(".weight")) in kinds
    ]


def _rows(weight, index):
    """`weight` with its rows in the order `index`."""
    from dataclasses import replace

    mins = None if weight.mins is None else weight.mins[index]
    return replace(
        weight,
        values=weight.values[index],
        scales=weight.scales[index],
        zeros=weight.zeros[index],
        mins=mins,
    )


def _one_layout_per_fusion(packed: dict, modules: list[str]) -> dict:
    """`packed` with the projections the engine fuses (FUSED; `modules`: the model's) in one
    layout each; a fusion with a member stored as floats (a per-tensor F16 override) stays float
    whole, dequantized."""
    from backend_lib import gguf_quants

    fusions: dict[str, list[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        fusions.setdefault(f"{parent}.{FUSED.get(leaf, leaf)}", []).append(module)
    out = {}
    for members in fusions.values():
        if not all(m in packed for m in members):
            continue  # a member is float: transformers' dequantized values serve them all
        weights = gguf_quants.harmonize([packed[m] for m in members])
        out.update(zip(members, weights, strict=True))
    return out


def _write_quantization_config(out: Path, packed: dict) -> None:
    """config.json's `quantization_config` (`quant_method: gguf`): each quantized module's bits,
    group size, whether it has float minimums, and its GGUF types; other linears stay float."""
    import json

    layers = {
        module: {
            "bits": w.bits,
            "group_size": w.group_size,
            "float_mins": w.mins is not None,
            "tensor_types": list(w.tensor_types),
        }
        for module, w in sorted(packed.items())
    }
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": "gguf", "layers": layers}
    config_path.write_text(json.dumps(config, indent=2))
