"""Random PEFT LoRA adapters for tests and benchmarks, built with `peft` itself on a base
`transformers` model and saved in PEFT's format (adapter_config.json + adapter_model.safetensors).

Both A and B are drawn at random (`init_lora_weights=False`; PEFT's default B = 0 would make an
adapter a no-op), so every adapter visibly changes the base model's outputs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    base: transformers.PreTrainedModel,
    out_dir: str | Path,
    rank: int,
    alpha: float,
    seed: int = 0,
    target_modules: tuple[str, ...] = ALL_PROJECTIONS,
    use_rslora: bool = False,
    b_std: float | None = None,
):
    """A random LoRA adapter on a copy of `base` (left untouched), saved to `out_dir`; returns the
    `PeftModel` (float32, eval): the independent reference the engine is checked against.
    `b_std`: redraw every B from N(0, b_std) (default: PEFT's uniform init)."""
    import peft  # a test and benchmark dependency, never imported by the runtime

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    if b_std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_std)
    model.save_pretrained(str(out_dir))
    return model.eval()


def merged_model(peft_model) -> transformers.PreTrainedModel:
    """The adapter merged into a copy of its base weights (PEFT's `merge_and_unload`)."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()
