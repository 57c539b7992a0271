"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`): transformers' vision tower (dynamic resolution: patches of
14 pixels over a 2 x 2 merge, Qwen2.5's window attention) in front of the registry's Qwen2
decoder, with M-RoPE positions.

M-RoPE gives each token three positions (temporal, height, width) and rotates each section of a
head's frequencies (`mrope_section`) by one of them. A text token's three are equal and follow on
from what came before; an image's tokens take their grid coordinates offset by where the image
starts, and the text after it continues from that start plus the grid's larger side
(`rope_positions`; transformers' `get_rope_index`). The kernels are untouched: a step's rotary
table is gathered from the model's cos/sin cache row by row, each column from the position of
its section (`mrope_table`), and the kernels rotate token t by row t of it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.execution.attention import AttentionMetadata
from backend_lib.llm.execution.models.llama import Qwen2ForCausalLM
from backend_lib.llm.execution.models.step_kernels import StepKernels
from backend_lib.llm.execution.models.vision_weights import VisionWeights, route

_PREFIXES = (
    # (checkpoint prefix, where it goes): Qwen's own layout first, transformers 5's after.
    ("model.language_model.", "model."),
    ("model.visual.", "visual:"),
    ("visual.", "visual:"),
)


def mrope_positions(
    features: Sequence[MultiModalFeature], merge: int, start: int, stop: int
) -> np.ndarray:
    """int64 [3, stop - start]: the (temporal, height, width) positions of a sequence's tokens
    [start, stop) whose images are `features` (each with its `image_grid_thw`)."""
    index = np.arange(start, stop)
    out = np.repeat(index[None, :], 3, axis=0)
    shift, previous_end = 0, 0  # shift: position - token index of the text after an image
    for feature in features:
        text = (index >= previous_end) & (index < feature.offset)
        out[:, text] += shift
        t, h, w = (int(v) for v in feature.data["image_grid_thw"].reshape(-1))
        height, width = h // merge, w // merge
        first = feature.offset + shift
        inside = (index >= feature.offset) & (index < feature.end)
        k = index[inside] - feature.offset
        out[0, inside] = first + k // (height * width)
        out[1, inside] = first + (k // width) % height
        out[2, inside] = first + k % width
        shift = first + max(height, width) - feature.end
        previous_end = feature.end
    out[:, index >= previous_end] += shift
    return out


def mrope_table(cache: torch.Tensor, positions: torch.Tensor, sections: Sequence[int]):
    """A step's rotary table [T, rotary_dim] for token t at positions[:, t] ([3, T]): each
    column of `cache` ([max_position, rotary_dim]: cos half, then sin half) taken from the row
    of its frequency's section."""
    half = cache.shape[1] // 2
    section_of = torch.repeat_interleave(
        torch.arange(3, device=cache.device), torch.tensor(list(sections), device=cache.device)
    )
    if len(section_of) != half:
        raise ValueError(f"mrope_section {list(sections)} does not cover the {half} frequencies")
    columns = torch.cat((section_of, section_of))  # the cos and sin halves alike
    rows = positions.index_select(0, columns.to(positions.device)).T  # [T, rotary_dim]
    return cache.gather(0, rows.to(cache.device))


VISION_TOWERS = {
    "qwen2_vl_vision": ("qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl_vision": ("qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
}
"""transformers' vision transformer of each family, by its vision config's `model_type`: its
`transformers.models.<family>.modeling_<family>` module and class name, imported on load, not at
start (docs/architecture.md, import rules)."""


class VisionTower:
    """transformers' Qwen2(.5)-VL vision transformer with its patch merger; a plain object, not
    a module of the decoder (the loader's passes leave it alone)."""

    def __init__(self, vision_config, device: torch.device):
        from transformers.initialization import no_init_weights

        family, class_name = VISION_TOWERS[vision_config.model_type]
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        tower_class = getattr(module, class_name)
        vision_config._attn_implementation = "sdpa"
        with no_init_weights(), torch.device(device):
            self.tower = tower_class(vision_config)
        self.merge = int(vision_config.spatial_merge_size)
        self.weights = VisionWeights({"visual": self.tower})

    @torch.inference_mode()
    def encode(self, datas: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's merged patch embeddings [t*h*w / merge^2, hidden_size]."""
        grids = torch.cat([d["image_grid_thw"] for d in datas])
        dtype = next(self.tower.parameters()).dtype
        pixels = torch.cat([d["pixel_values"] for d in datas]).to(dtype)
        merged = self.tower(pixels, grid_thw=grids).pooler_output
        return list(merged.split((grids.prod(-1) // self.merge**2).tolist()))


class Qwen2VLForConditionalGeneration:
    """The registry's entry for Qwen2-VL and Qwen2.5-VL checkpoints: `for_config` makes the class
    of one."""

    @staticmethod
    def for_config(cfg: Mapping[str, Any]) -> type[Qwen2ForCausalLM]:
        import transformers

        config = transformers.CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg))
        return vision_language_class(config)


def vision_language_class(config) -> type[Qwen2ForCausalLM]:
    """The Qwen2 decoder with `config`'s vision tower and M-RoPE (a class per checkpoint)."""
    text = config.text_config.to_dict()
    rope = dict(text.get("rope_parameters") or {})
    sections = tuple(rope.pop("mrope_section", ()))
    rope["rope_type"] = "default" if rope.get("rope_type") in (None, "mrope") else rope["rope_type"]
    decoder_fields = {**text, "rope_parameters": rope}
    merge = int(config.vision_config.spatial_merge_size)

    class QwenVLDecoder(Qwen2ForCausalLM):
        supports_tensor_parallel = False
        supports_pipeline_parallel = False
        image_token_id: int = config.image_token_id
        """The placeholder token of an image."""
        decoder_config: Mapping[str, Any] = decoder_fields
        """The decoder's config.json fields (`text_config`, M-RoPE's sections taken out)."""
        mrope_section: tuple[int, ...] = sections
        """Frequencies of a head rotated by the temporal, height and width positions."""

        @classmethod
        def args_from_config(cls, cfg: Mapping[str, Any]):
            return Qwen2ForCausalLM.args_from_config(decoder_fields)

        def __init__(self, args, ops, device, *rest):
            super().__init__(args, ops, device, *rest)
            self.vision = VisionTower(config.vision_config, torch.device(device))

        def encode_images(self, datas: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
            return self.vision.encode(datas)

        def image_tokens(self, data: Mapping[str, torch.Tensor]) -> int:
            """Placeholder tokens of one processed image: its patch grid over the merge."""
            return int(data["image_grid_thw"].prod()) // merge**2

        def rope_positions(
            self, features_of: Sequence[Sequence[MultiModalFeature]], starts, lens
        ) -> torch.Tensor:
            """int64 [3, T]: the step's M-RoPE positions, row-layout order."""
            return torch.from_numpy(
                np.concatenate(
                    [
                        mrope_positions(f, merge, int(s), int(s) + int(n))
                        for f, s, n in zip(features_of, starts, lens, strict=True)
                    ],
                    axis=1,
                )
            )

        def step_kernels(self, positions: torch.Tensor, meta: AttentionMetadata) -> StepKernels:
            if positions.dim() == 1:  # no image in the step's sequences: plain positions
                return super().step_kernels(positions, meta)
            table = mrope_table(self.rope_cache, positions, self.mrope_section)
            rows = torch.arange(positions.shape[1], device=positions.device)
            return super().step_kernels(rows, meta, table)  # token t rotated by row t

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            super().load_weights(route(weights, _PREFIXES, self.vision.weights))
            self.vision.weights.finish_loading(self.model.embed_tokens.weight.dtype)

    QwenVLDecoder.__name__ = QwenVLDecoder.__qualname__ = f"{type(config).__name__}Decoder"
    return QwenVLDecoder
