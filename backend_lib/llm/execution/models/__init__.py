"""Architecture registry: HF `architectures[0]` name -> model class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from backend_lib.llm.execution.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from backend_lib.llm.execution.models.gemma3_vision import Gemma3ForConditionalGeneration
from backend_lib.llm.execution.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from backend_lib.llm.execution.models.llava import LlavaForConditionalGeneration
from backend_lib.llm.execution.models.moe import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from backend_lib.llm.execution.models.phi3 import Phi3ForCausalLM
from backend_lib.llm.execution.models.qwen2_vl import Qwen2VLForConditionalGeneration

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}
"""A model class, or a family whose `for_config(cfg)` makes the class of one checkpoint (the
vision-language models: their decoder depends on the checkpoint's `text_config`)."""


def resolve_model_class(arch: str, cfg: Mapping[str, Any]) -> type[nn.Module]:
    """The class that builds a checkpoint of architecture `arch` (config.json `cfg`)."""
    entry = MODEL_REGISTRY[arch]
    return entry.for_config(cfg) if hasattr(entry, "for_config") else entry


def decoder_config(model_class: type[nn.Module], cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's config fields: a vision-language model's `text_config`, else `cfg`."""
    return getattr(model_class, "decoder_config", cfg)


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)
