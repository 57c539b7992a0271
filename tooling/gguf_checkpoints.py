"""GGUF files for the tests, written with the `gguf` package (the format's own library) from a
Llama, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) or Phi-3 checkpoint in Hugging Face form, laid out as
llama.cpp's converter (convert_hf_to_gguf.py) lays them out: its architecture's metadata keys, the
tensor names of gguf-py's own map (`gguf.get_tensor_name_map`: Qwen2's q/k/v biases, the q/k
norms of Qwen3 and Gemma 3, Gemma's four norms a layer, Phi-3's fused `attn_qkv` and its `ffn_up`
holding gate and up), a Llama's query and key rows permuted for its rotary layout, Gemma's norms
stored as 1 + w, and the byte-level BPE tokenizer as `tokenizer.ggml.*` (gpt2 model: tokens,
types, merges).

The K-quants (Q4_K, Q5_K, Q6_K), which gguf-py reads but does not write, are quantized here in
llama.cpp's block layouts by a plain rounding (`quantize_k`: per sub-block a float range on
6-bit scales and minimums, or Q6_K's symmetric 8-bit scales), not llama.cpp's search for the
best scales: what matters is that the blocks are laid out as llama.cpp lays them out.

    write_gguf(Path("models/shakespeare-llama"), Path("/tmp/shakespeare.gguf"), "F16")
    write_gguf(hf_dir, out, {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, default_type="Q4_K")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH
from safetensors.torch import load_file

NUMPY_TYPES = {"F32": np.float32, "F16": np.float16}
GGML_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q4_K": gguf.GGMLQuantizationType.Q4_K,
    "Q5_K": gguf.GGMLQuantizationType.Q5_K,
    "Q6_K": gguf.GGMLQuantizationType.Q6_K,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
    "Q2_K": gguf.GGMLQuantizationType.Q2_K,
}
ARCHITECTURES = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "gemma2": MODEL_ARCH.GEMMA2,
    "gemma3_text": MODEL_ARCH.GEMMA3,
    "phi3": MODEL_ARCH.PHI3,
}
"""config.json's model_type -> llama.cpp's architecture."""
GEMMAS = (MODEL_ARCH.GEMMA2, MODEL_ARCH.GEMMA3)
"""Architectures whose RMSNorm scales by 1 + w: llama.cpp stores 1 + w."""


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order for a query or key projection (its rotary pairs adjacent)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    hf_dir: Path,
    out: Path,
    tensor_type: str | Mapping[str, str] = "F32",
    embedding_type: str = "F32",
    default_type: str = "F32",
    output_type: str | None = None,
) -> Path:
    """Write the checkpoint in `hf_dir` as a GGUF file at `out`; its 2-D projection weights in
    `tensor_type` (GGML_TYPES), or per projection (a mapping from llama.cpp's short name, e.g.
    "attn_v", or one layer's tensor, e.g. "blk.2.attn_v", to a type; the others in
    `default_type`), norms in F32, the embedding in `embedding_type` and an untied output head in
    `output_type` (None: `embedding_type`)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, config, arch, hf_dir.name)
    _write_tokenizer(writer, hf_dir, config)
    for hf_name, gguf_name in _tensor_names(arch, config, state).items():
        weight = _as_llama_cpp_stores(
            state[hf_name].to(torch.float32).numpy(), hf_name, arch, config
        )
        if gguf_name == "token_embd.weight":
            _add(writer, gguf_name, weight, embedding_type)
        elif gguf_name == "output.weight":
            _add(writer, gguf_name, weight, output_type or embedding_type)
        elif weight.ndim == 2:
            _add(writer, gguf_name, weight, _projection_type(gguf_name, tensor_type, default_type))
        else:
            _add(writer, gguf_name, weight, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _tensor_names(arch: MODEL_ARCH, config: dict, state: dict) -> dict[str, str]:
    """Hugging Face tensor name -> llama.cpp's, by gguf-py's map of `arch`, for every tensor
    written: the checkpoint's, less a tied head, in its order (llama.cpp's converter walks the
    safetensors file's sorted names: blk.0.ffn_down before blk.0.attn_q)."""
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", False)
    out = {}
    for hf_name in state:
        if (tied and hf_name == "lm_head.weight") or hf_name.endswith(".rotary_emb.inv_freq"):
            continue  # a tied head is the embedding; rotary tables are computed, not stored
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(
                f"{hf_name} has no {gguf.MODEL_ARCH_NAMES[arch]} name in gguf-py's map"
            )
        out[hf_name] = gguf_name
    return out


def _as_llama_cpp_stores(
    weight: np.ndarray, hf_name: str, arch: MODEL_ARCH, config: dict
) -> np.ndarray:
    """A tensor as llama.cpp's converter writes it: a Llama's query and key rows in its rotary
    order (the other architectures here rotate halves, NEOX-style, as transformers does); Gemma's
    norm weights w, q/k norms included, as 1 + w (transformers' GGUF reader subtracts the 1)."""
    if arch == MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
        return permute_rotary(weight, heads)
    if arch in GEMMAS and hf_name.endswith("norm.weight"):
        return weight + 1
    return weight


def _projection_type(name: str, tensor_type: str | Mapping[str, str], default: str) -> str:
    """The type of projection `name` (blk.<i>.<short name>.weight): its own entry in
    `tensor_type` ("blk.2.attn_v"), else its short name's ("attn_v"), else `default`."""
    if isinstance(tensor_type, str):
        return tensor_type
    layer_tensor = name.removesuffix(".weight")
    return tensor_type.get(layer_tensor, tensor_type.get(layer_tensor.split(".")[2], default))


def _add(writer: gguf.GGUFWriter, name: str, weight: np.ndarray, tensor_type: str) -> None:
    if tensor_type == "Q2_K":  # gguf-py writes no Q2_K: zero blocks, for refusal tests
        kind = GGML_TYPES[tensor_type]
        data = np.zeros((weight.shape[0], weight.shape[1] // 256 * 84), dtype=np.uint8)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        return
    if tensor_type in NUMPY_TYPES:
        writer.add_tensor(name, weight.astype(NUMPY_TYPES[tensor_type]))
        return
    if tensor_type in K_QUANTS and weight.shape[1] % 256:
        tensor_type = K_FALLBACK[tensor_type]  # as llama.cpp: rows not in whole super-blocks
    kind = GGML_TYPES[tensor_type]
    if tensor_type in K_QUANTS:
        data = quantize_k(weight.astype(np.float32), tensor_type)
    else:
        data = gguf.quants.quantize(weight.astype(np.float32), kind)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's type for a tensor whose rows are not whole 256-value super-blocks."""


def quantize_k(weight: np.ndarray, kind: str) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> `kind`'s blocks, uint8 [N, K / 256 * block bytes]."""
    rows = weight.shape[0]
    blocks = weight.reshape(-1, 256)
    data = _q6_k(blocks) if kind == "Q6_K" else _q45_k(blocks, 5 if kind == "Q5_K" else 4)
    return data.reshape(rows, -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: per sub-block of 32, scale = range / (2^bits - 1) and min = -lower bound, on
    6-bit multiples of the block's d and dmin."""
    top = (1 << bits) - 1
    x = blocks.reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0)
    scale, minimum = (x.max(-1) - low) / top, -low
    d = _f16_bytes(scale.max(-1) / 63).view(np.float16).astype(np.float32)
    dmin = _f16_bytes(minimum.max(-1) / 63).view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(scale / d), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin > 0, np.round(minimum / dmin), 0).clip(0, 63).astype(np.uint8)
        step = d * sc
        q = np.where(
            step[..., None] > 0, np.round((x + (dmin * mn)[..., None]) / step[..., None]), 0
        )
    q = q.clip(0, top).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), packed_scales]
    if bits == 5:
        high = (q >> 4) & 1  # [blocks, 8, 32]: bit i of byte l is sub-block i's value l
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: per sub-block of 16, a symmetric scale (max |x| / 31) on an int8 multiple of d."""
    x = blocks.reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = _f16_bytes(scale.max(-1) / 127).view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(scale / d), 0).clip(-128, 127).astype(np.int8)
        step = d * sc.astype(np.float32)
        q = np.where(step[..., None] > 0, np.round(x / step[..., None]), 0)
    u = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    quarters = high.reshape(-1, 2, 4, 32)  # value h * 128 + s * 32 + c
    qh = (quarters << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2)
    return np.concatenate(
        [ql, qh.astype(np.uint8).reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1
    )


def _write_metadata(writer: gguf.GGUFWriter, config: dict, arch: MODEL_ARCH, name: str) -> None:
    """The keys llama.cpp's converter writes for `arch`: its base model's, then the
    architecture's own (ARCH_METADATA)."""
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:  # written where config.json names one
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    if arch in ARCH_METADATA:
        ARCH_METADATA[arch](writer, config)


def _rope_theta(config: dict) -> float:
    """The rope base llama.cpp stores: Gemma 3's global layers' (its local ones' is fixed)."""
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return rope.get("rope_theta", config.get("rope_theta", 10000.0))


def _llama_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)


def _gemma2_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_sliding_window(config["sliding_window"])
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])


GEMMA3_GLOBAL_EVERY = 6
"""llama.cpp's Gemma 3 attends globally in every sixth layer and locally in the others: the
file holds no pattern."""


def _gemma3_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    layers = config["num_hidden_layers"]
    fixed = [
        "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if config.get("layer_types", fixed) != fixed:
        raise ValueError(f"Gemma 3 layer_types {config['layer_types']}: a GGUF holds {fixed}")
    writer.add_sliding_window(config["sliding_window"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    full = (config.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type") == "linear":  # the larger Gemma 3s' global layers
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def _phi3_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        # llama.cpp stores LongRoPE's factors as rope_factors_long / _short tensors, which no
        # reader here reads (transformers' GGUF support maps neither them nor rope.scaling.*).
        raise NotImplementedError(f"Phi-3 with rope_type {rope['rope_type']!r}")
    original = config.get("original_max_position_embeddings") or config["max_position_embeddings"]
    rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(
        int(rotary * config["hidden_size"]) // config["num_attention_heads"]
    )
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: none (llama.cpp's mark)


ARCH_METADATA: dict[MODEL_ARCH, Callable[[gguf.GGUFWriter, dict], None]] = {
    MODEL_ARCH.LLAMA: _llama_metadata,
    MODEL_ARCH.GEMMA2: _gemma2_metadata,
    MODEL_ARCH.GEMMA3: _gemma3_metadata,
    MODEL_ARCH.PHI3: _phi3_metadata,
}
"""The keys an architecture's converter class adds (Qwen2 and Qwen3 add none)."""


def _write_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's gpt2 tokenizer model."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(True)


FAMILIES = (
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen2ForCausalLM",
    "Gemma2ForCausalLM",
)
"""The other architectures `build_family_checkpoint` builds, the least like a Llama first."""
FAMILY_SETTINGS: dict[str, dict] = {
    # Qwen3's own head_dim (not hidden / heads): transformers' GGUF reader maps no
    # qwen3.attention.key_length and takes Qwen3Config's default, 128.
    "Qwen3ForCausalLM": dict(head_dim=128),
    # Gemma's attention scale is not in the file: llama.cpp takes 1 / sqrt(head_dim),
    # transformers its configs' default query_pre_attn_scalar (256), so head_dim is 256, as in
    # Gemma's own; the soft-caps are Gemma 2's (transformers' reader takes its defaults).
    "Gemma2ForCausalLM": dict(
        head_dim=256,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # Six layers: five local (window 8, shorter than the tests' prompts) and one global, the
    # pattern llama.cpp fixes; one key/value head, rope bases 1e6 (global) and 10000 (local)
    # unscaled, as Gemma 3 1B.
    "Gemma3ForCausalLM": dict(
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=8,
        layer_types=None,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # Phi-3 mini 4k's form: untied head, plain rope over the whole context.
    "Phi3ForCausalLM": dict(
        tie_word_embeddings=False,
        original_max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
"""Per architecture, settings a GGUF file holds as the checkpoint has them: each reader (llama.cpp,
transformers' `gguf_file=`) gets the checkpoint's own model back."""


def build_family_checkpoint(arch: str, out: Path, seed: int = 0, *, untied: bool = False) -> Path:
    """A random `arch` checkpoint (FAMILIES) of the Shakespeare model's width (hidden 256: whole
    K-quant super-blocks) on its tokenizer, to write as GGUF (FAMILY_SETTINGS; `untied`: with an
    output head of its own). Gemma's head is tied, as in its real checkpoints, and its embedding
    drawn small, so that the tied head over the sqrt(hidden)-scaled embedding does not only
    repeat the last token."""
    from safetensors.torch import save_file

    from tooling.checkpoints import SHAKESPEARE_DIR, build_checkpoint

    vocab = json.loads((SHAKESPEARE_DIR / "config.json").read_text())["vocab_size"]
    settings = dict(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(
        FAMILY_SETTINGS.get(arch, {}), **({"tie_word_embeddings": False} if untied else {})
    )
    model = build_checkpoint(arch, out, seed, **settings)
    if arch.startswith("Gemma"):
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 0.05
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((SHAKESPEARE_DIR / name).read_bytes())
    return out
