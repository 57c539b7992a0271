"""GGUF files for the tests, written with the `gguf` package (the format's own library) from a
Llama-family checkpoint in Hugging Face form, laid out as llama.cpp's converter lays them out:
its metadata keys, its tensor names, the query and key rows permuted for its rotary layout, and
the byte-level BPE tokenizer as `tokenizer.ggml.*` (gpt2 model: tokens, types, merges).

    write_gguf(Path("models/shakespeare-llama"), Path("/tmp/shakespeare.gguf"), "F16")
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

NUMPY_TYPES = {"F32": np.float32, "F16": np.float16}
GGML_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
}
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's row order for a query or key projection (its rotary pairs adjacent)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    hf_dir: Path, out: Path, tensor_type: str = "F32", embedding_type: str = "F32"
) -> Path:
    """Write the checkpoint in `hf_dir` as a GGUF file at `out`; its 2-D projection weights in
    `tensor_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1), norms and embeddings in F32 (the
    embedding in `embedding_type`)."""
    config = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_metadata(writer, config, hf_dir.name)
    _write_tokenizer(writer, hf_dir, config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not config.get("tie_word_embeddings", False):
        names["lm_head.weight"] = "output.weight"
    for i in range(config["num_hidden_layers"]):
        for hf, ours in LAYER_TENSORS.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    for hf_name, gguf_name in names.items():
        weight = state[hf_name].to(torch.float32).numpy()
        if gguf_name.endswith("attn_q.weight"):
            weight = permute_rotary(weight, heads)
        elif gguf_name.endswith("attn_k.weight"):
            weight = permute_rotary(weight, kv_heads)
        if gguf_name == "token_embd.weight":
            _add(writer, gguf_name, weight, embedding_type)
        else:
            _add(writer, gguf_name, weight, tensor_type if weight.ndim == 2 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add(writer: gguf.GGUFWriter, name: str, weight: np.ndarray, tensor_type: str) -> None:
    if tensor_type in NUMPY_TYPES:
        writer.add_tensor(name, weight.astype(NUMPY_TYPES[tensor_type]))
        return
    kind = GGML_TYPES[tensor_type]
    data = gguf.quants.quantize(weight.astype(np.float32), kind)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def _write_metadata(writer: gguf.GGUFWriter, config: dict, name: str) -> None:
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


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
