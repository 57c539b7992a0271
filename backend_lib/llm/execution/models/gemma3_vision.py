"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower whose patch grid
is average-pooled to `mm_tokens_per_image` tokens, normed and projected (transformers'
`Gemma3MultiModalProjector`), in front of the registry's Gemma 3 decoder.

What differs from Llava (models/llava.py):
- A prompt marks an image with `<start_of_image>`; the processor puts
  "\\n\\n<start_of_image>", the image's soft tokens and "<end_of_image>\\n\\n" there
  (`image_prompt`), and only the soft tokens take the projector's output.
- An image's soft tokens attend to each other both ways (transformers' block mask; the sliding
  layers still apply their window to it). Its features are marked `bidirectional`: the step
  batch gives each of its rows the image's last position as the last key it sees
  (`visible_until`, kernels/paged_attention.py), and the scheduler computes an image in one
  chunk (core/multimodal.py `chunk_end`).
- The image rows replace the token embeddings after Gemma's sqrt(hidden_size) scaling, as
  transformers does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from backend_lib.llm.execution.models.gemma import Gemma3ForCausalLM
from backend_lib.llm.execution.models.vision_weights import VisionWeights, route

if TYPE_CHECKING:  # imported on load, not at start (docs/architecture.md, import rules)
    import transformers

_PREFIXES = (
    # (checkpoint prefix, where it goes): the hub's layout first, transformers 5's own after.
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("vision_tower.vision_model.", "vision:"),
    ("model.vision_tower.vision_model.", "vision:"),
    ("vision_tower.", "vision:"),
    ("model.vision_tower.", "vision:"),
    ("multi_modal_projector.", "projector:"),
    ("model.multi_modal_projector.", "projector:"),
)

IMAGE_PROMPT = "\n\n{boi}{image}{eoi}\n\n"
"""What `Gemma3Processor` puts in place of each <start_of_image> ({image}: the soft tokens)."""


class VisionTower:
    """The SigLIP tower and projector of one Gemma 3 checkpoint; a plain object, not a module of
    the decoder (the loader's passes over the decoder's parameters leave it alone)."""

    def __init__(self, config: transformers.Gemma3Config, device: torch.device):
        import transformers
        from transformers.initialization import no_init_weights
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        with no_init_weights(), torch.device(device):
            self.tower = transformers.AutoModel.from_config(
                config.vision_config, attn_implementation="sdpa"
            )
            self.projector = Gemma3MultiModalProjector(config)
        self.weights = VisionWeights({"vision": self.tower, "projector": self.projector})

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, H, W] -> image features [N, mm_tokens_per_image, hidden_size]
        (transformers' `get_image_features`)."""
        dtype = next(self.projector.parameters()).dtype
        states = self.tower(pixel_values.to(dtype), return_dict=True).last_hidden_state
        return self.projector(states)


class Gemma3ForConditionalGeneration:
    """The registry's entry for Gemma 3 vision-language checkpoints: `for_config` makes the class
    of one."""

    @staticmethod
    def for_config(cfg: Mapping[str, Any]) -> type[Gemma3ForCausalLM]:
        import transformers

        config = transformers.Gemma3Config.from_dict(dict(cfg))
        if config.text_config.model_type != "gemma3_text":
            raise ValueError(f"Gemma 3 text_config.model_type {config.text_config.model_type!r}")
        return vision_language_class(config)


def vision_language_class(config: transformers.Gemma3Config) -> type[Gemma3ForCausalLM]:
    """The Gemma 3 decoder with `config`'s vision tower (a class per checkpoint)."""
    # The head is tied or not as the whole model says (transformers reads the outer config).
    text = dict(config.text_config.to_dict(), tie_word_embeddings=config.tie_word_embeddings)
    tokens_per_image = int(config.mm_tokens_per_image)

    class Gemma3VisionDecoder(Gemma3ForCausalLM):
        supports_tensor_parallel = False
        supports_pipeline_parallel = False
        image_token_id: int = config.image_token_id
        """The soft token each image row fills."""
        image_placeholder_id: int = config.boi_token_index
        """What a prompt puts where an image goes (<start_of_image>)."""
        image_prompt: str = IMAGE_PROMPT
        image_prompt_tokens: Mapping[str, int] = {
            "boi": config.boi_token_index,
            "eoi": config.eoi_token_index,
        }
        bidirectional_images = True
        max_image_tokens: int = tokens_per_image
        """The most tokens one image takes (each is computed in one step)."""
        decoder_config: Mapping[str, Any] = text
        """The decoder's config.json fields (`text_config`, the outer tie setting)."""

        @classmethod
        def args_from_config(cls, cfg: Mapping[str, Any]):
            return Gemma3ForCausalLM.args_from_config(text)

        def __init__(self, args, ops, device, *rest):
            super().__init__(args, ops, device, *rest)
            self.vision = VisionTower(config, torch.device(device))

        def encode_images(self, datas: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
            """Each image's soft-token embeddings [mm_tokens_per_image, hidden_size] from its
            pixel_values [1, 3, H, W] (one size for all: the processor resizes to it)."""
            return list(self.vision.encode(torch.cat([d["pixel_values"] for d in datas])))

        def image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
            """Soft tokens of one processed image: `mm_tokens_per_image`."""
            return tokens_per_image

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(route(weights, _PREFIXES, self.vision.weights))
            self.vision.weights.finish_loading(self.model.embed_tokens.weight.dtype)

    return Gemma3VisionDecoder
