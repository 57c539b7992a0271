"""Llava (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower and an MLP projector in
front of one of the registry's decoders (the checkpoint's `text_config`: Llama, Mistral, Qwen2).

The decoder is the registry's own class, subclassed per checkpoint (`vision_language_class`), so
it runs on the paged KV cache, the kernels and the step batching like any text model: the only
difference is that the step's image placeholder rows take the projector's output instead of
the token embedding (`MultiModalEmbeds`, set after the embedding lookup).

The vision tower is transformers' own module (`CLIPVisionModel`, `SiglipVisionModel`), held
outside the decoder's parameters: the loader's meta-device build, linear packing and
quantization apply to the decoder alone, and the tower runs in the model's dtype as transformers
runs it (SDPA attention). Its output per image is what transformers' `get_image_features`
returns: the hidden states of `vision_feature_layer` (a list: concatenated), less the CLS row
under the "default" strategy, through the projector.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from backend_lib.llm.execution.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
)
from backend_lib.llm.execution.models.vision_weights import VisionWeights, route

if TYPE_CHECKING:  # imported on load, not at start (docs/architecture.md, import rules)
    import transformers

TEXT_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}
"""The decoders a Llava checkpoint may have, by `text_config.model_type`."""

_PREFIXES = (
    # (checkpoint prefix, where it goes): llava-hf's layout first, transformers 5's own after.
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.", "vision:"),
    ("model.vision_tower.", "vision:"),
    ("multi_modal_projector.", "projector:"),
    ("model.multi_modal_projector.", "projector:"),
)


def llava_config(cfg: Mapping[str, Any]) -> transformers.LlavaConfig:
    """config.json as transformers reads it (every default of the sub-configs filled in)."""
    import transformers

    return transformers.LlavaConfig.from_dict(dict(cfg))


class VisionTower:
    """The vision tower and projector of one Llava checkpoint. A plain object, not a module of the
    decoder, so the loader's passes over the decoder's parameters leave it alone."""

    def __init__(self, config: transformers.LlavaConfig, device: torch.device):
        import transformers
        from transformers.initialization import no_init_weights
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.config = config
        # Real tensors on `device` even inside the loader's meta-device context; no random
        # init (every parameter is loaded), but the non-persistent buffers (position ids) built.
        with no_init_weights(), torch.device(device):
            self.tower = transformers.AutoModel.from_config(
                config.vision_config, attn_implementation="sdpa"
            )
            self.projector = LlavaMultiModalProjector(config)
        self.weights = VisionWeights({"vision": self.tower, "projector": self.projector})

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, H, W] -> projected image features [N, tokens, text hidden_size]."""
        c = self.config
        dtype = next(self.projector.parameters()).dtype
        out = self.tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        layers = c.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        states = [out.hidden_states[i] for i in layers]
        if c.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.projector(torch.cat(states, dim=-1))


class LlavaForConditionalGeneration:
    """The registry's entry for Llava checkpoints: `for_config` makes the class of one."""

    @staticmethod
    def for_config(cfg: Mapping[str, Any]) -> type[LlamaForCausalLM]:
        """The decoder class of this checkpoint's `text_config`, extended with its vision tower."""
        config = llava_config(cfg)
        text_type = config.text_config.model_type
        if text_type not in TEXT_MODELS:
            supported = ", ".join(sorted(TEXT_MODELS))
            raise ValueError(f"Llava text_config.model_type {text_type!r}; supported: {supported}")
        return vision_language_class(TEXT_MODELS[text_type], config)


def vision_language_class(
    decoder: type[LlamaForCausalLM], config: transformers.LlavaConfig
) -> type[LlamaForCausalLM]:
    """`decoder` with the vision tower of `config` (a class per checkpoint: its loader builds it
    with the registry's constructor arguments)."""
    text_config = config.text_config.to_dict()
    vision = config.vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2 + int(
        config.vision_feature_select_strategy == "full"
    )

    class LlavaDecoder(decoder):
        supports_tensor_parallel = False
        supports_pipeline_parallel = False
        image_token_id: int = config.image_token_id
        """The placeholder token of an image."""
        decoder_config: Mapping[str, Any] = text_config
        """The decoder's config.json fields (the checkpoint's `text_config`, defaults filled)."""

        @classmethod
        def args_from_config(cls, cfg: Mapping[str, Any]):
            return decoder.args_from_config(text_config)

        def __init__(self, args, ops, device, *rest):
            super().__init__(args, ops, device, *rest)
            self.vision = VisionTower(config, torch.device(device))

        def encode_images(self, datas: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
            """Each image's placeholder embeddings [tokens, hidden_size] from its processed
            tensors (pixel_values [1, 3, H, W]); images of one size are encoded together."""
            by_shape: dict[tuple[int, ...], list[int]] = {}
            for i, data in enumerate(datas):
                by_shape.setdefault(tuple(data["pixel_values"].shape), []).append(i)
            out: list[torch.Tensor] = [None] * len(datas)  # type: ignore[list-item]
            for indices in by_shape.values():
                pixels = torch.cat([datas[i]["pixel_values"] for i in indices])
                for i, rows in zip(indices, self.vision.encode(pixels), strict=True):
                    out[i] = rows
            return out

        def image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
            """Placeholder tokens of one processed image: the tower's patches (and its CLS row
            under the "full" strategy)."""
            return image_tokens

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(route(weights, _PREFIXES, self.vision.weights))
            self.vision.weights.finish_loading(self.model.embed_tokens.weight.dtype)

    LlavaDecoder.__name__ = LlavaDecoder.__qualname__ = f"Llava{decoder.__name__}"
    return LlavaDecoder
