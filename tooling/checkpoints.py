"""Random-weight Hugging Face checkpoints for tests and benchmarks: tiny ones of each supported
architecture, saved to a dir.

Every parameter is drawn at random (norm weights around 1, biases non-zero) so that each
variant feature (biases, q/k norm, tied head, ...) visibly changes the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# Per architecture: its config class and the settings that exercise its distinctive features.
_VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    # llama3 rope scaling with a short original context so the scaled frequencies matter.
    "LlamaForCausalLM": (
        transformers.LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    # A window shorter than the test prompts.
    "MistralForCausalLM": (transformers.MistralConfig, dict(sliding_window=7, head_dim=16)),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    # head_dim 32 != hidden/heads = 16; MQA-style ratio 4:1.
    "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(head_dim=32, num_key_value_heads=1)),
}


def hf_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    config_cls, variant = _VARIANTS[arch]
    config = config_cls(**{**_BASE, **variant, **overrides})
    config.architectures = [arch]
    return config


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: weights N(0, 0.15), norms 1 + N(0, 0.1), biases N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)


def build_checkpoint(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Create a random `arch` model, save it (safetensors) to `out_dir`, return it (float32, eval)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch, **overrides), dtype=torch.float32
    )
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model.eval()
