"""A vision-language model's prompt processing: the prompt's token ids with one image placeholder
token per image (the tokenized text, or ids as given), and decoded images, in; the ids with each
placeholder expanded to its image's tokens, and one `MultiModalFeature` per image, out.

The images go through the checkpoint's own image processor (preprocessor_config.json: resize,
crop, normalisation; transformers' PIL backend), one at a time, and the model says how many
tokens each one takes (`image_tokens`). Expanding each placeholder token to that many copies is
what the checkpoint's transformers processor does to the text, so the engine sees the ids
`generate` sees; it needs no processor class of its own (Qwen2-VL's needs torchvision for its
video half). Runs on the caller's thread (input_processor.py); every problem is an InputError for
that request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from backend_lib.checkpoint import HF_OFFLINE_KWARGS
from backend_lib.config import require
from backend_lib.errors import InputError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.multimodal_config import MultiModalConfig
from backend_lib.multimodal.images import DecodedImage
from backend_lib.multimodal.resize import check_processor_fits, check_resized

ImageTokens = Callable[[Mapping[str, Any]], int]
"""The model's placeholder tokens for one processed image (its image processor's tensors)."""


class MultiModalProcessor:
    """The image side of one vision-language model's input processing (thread-safe)."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        image_token_id: int,
        image_tokens: ImageTokens,
        config: MultiModalConfig,
    ):
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", **HF_OFFLINE_KWARGS
        )
        self.image_token_id, self.image_tokens = image_token_id, image_tokens
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        """The placeholder as text, for error messages."""
        self.config = config
        check_processor_fits(self.image_processor, config.limits)

    def process(
        self, ids: list[int], images: Sequence[DecodedImage]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """The prompt's token ids with its images' placeholders expanded, and the images'
        features in prompt order."""
        if len(images) > self.config.max_images:
            raise InputError(
                f"the prompt has {len(images)} images; at most {self.config.max_images} are "
                "allowed (limit_mm_per_prompt)"
            )
        placeholders = [p for p, token in enumerate(ids) if token == self.image_token_id]
        if len(placeholders) != len(images):
            raise InputError(
                f"the prompt has {len(placeholders)} image placeholders ({self.image_token}) "
                f"for {len(images)} images: put one where each image goes"
            )
        datas = [self._preprocess(image) for image in images]
        return _expand(ids, placeholders, images, datas, [self.image_tokens(d) for d in datas])

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt without images must not hold image placeholder tokens (they would be
        computed as text)."""
        if self.image_token_id in ids:
            raise InputError(
                f"the prompt holds image placeholders ({self.image_token}) but no images"
            )

    def _preprocess(self, image: DecodedImage) -> dict[str, Any]:
        """The image processor's tensors for one image (pixel_values, and e.g. image_grid_thw)."""
        check_resized(self.image_processor, *image.size, self.config.limits)
        try:
            return dict(self.image_processor(images=[image.image], return_tensors="pt"))
        except (ValueError, TypeError) as exc:
            raise InputError(f"the image cannot be processed for this model: {exc}") from None


def image_processor_for(
    model, model_dir: Path, tokenizer: PreTrainedTokenizerBase, config: LLMConfig
) -> MultiModalProcessor | None:
    """The image processing of an engine's model: None for a text model; ConfigError for a
    setting not served with images yet."""
    image_token_id = getattr(model, "image_token_id", None)
    if image_token_id is None:
        return None
    for key, on in (
        ("enable_lora", config.enable_lora),
        ("speculative_config", config.speculative is not None),
    ):
        require(not on, key, getattr(config, key), "not served with images yet")
    settings = MultiModalConfig.of(config)
    return MultiModalProcessor(model_dir, tokenizer, image_token_id, model.image_tokens, settings)


def _expand(
    ids: list[int],
    placeholders: list[int],
    images: Sequence[DecodedImage],
    datas: list[dict[str, Any]],
    counts: list[int],
) -> tuple[list[int], list[MultiModalFeature]]:
    """`ids` with placeholder token i repeated counts[i] times, and each image's feature."""
    out: list[int] = []
    features = []
    previous = 0
    for place, image, data, count in zip(placeholders, images, datas, counts, strict=True):
        out += ids[previous:place]
        features.append(MultiModalFeature(image.digest, len(out), count, data))
        out += [ids[place]] * count
        previous = place + 1
    out += ids[previous:]
    return out, features
