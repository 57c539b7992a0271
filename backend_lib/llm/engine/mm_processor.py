"""A vision-language model's prompt processing: a prompt with one image placeholder per image
(text, or token ids) and decoded images in; the token ids with each placeholder replaced by its
image's tokens, and one `MultiModalFeature` per image, out.

The images go through the checkpoint's own image processor (preprocessor_config.json: resize,
crop, normalisation; transformers' PIL backend), one at a time, and the model says how many
tokens each one takes (`image_tokens`) and how its processor wraps them (`ImagePrompt`: Llava
and Qwen2-VL repeat the placeholder, Gemma 3 puts markers and blank lines around its soft
tokens). A text prompt gets that replacement in its text before it is tokenized, exactly as the
checkpoint's transformers processor does, so the engine sees the ids `generate` sees; a token-id
prompt gets the wrapping as tokenized alone. No processor class is needed (Qwen2-VL's needs
torchvision for its video half). Runs on the caller's thread (input_processor.py); every problem
is an InputError for that request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ImagePrompt:
    """How a model's prompts hold an image: the token a prompt puts where the image goes, and the
    text its processor puts there instead (the image's tokens inside, maybe between markers)."""

    placeholder_id: int
    """The token marking an image in a prompt (Llava's <image>, Gemma 3's <start_of_image>)."""
    image_token_id: int
    """The token repeated once per encoder output row (the rows the image's embeddings fill)."""
    before: str = ""
    """Text the processor puts before those tokens (Gemma 3: "\\n\\n<start_of_image>")."""
    after: str = ""
    """And after them (Gemma 3: "<end_of_image>\\n\\n")."""
    bidirectional: bool = False
    """The image's tokens attend to each other both ways (its features say so)."""

    @classmethod
    def of(cls, model, tokenizer: PreTrainedTokenizerBase) -> ImagePrompt:
        """The image prompt of a vision-language model (its `image_token_id`, and where its
        processor wraps the image tokens: `image_placeholder_id`, `image_prompt` with
        `image_prompt_tokens`)."""
        token_text = {
            name: tokenizer.convert_ids_to_tokens(token)
            for name, token in getattr(model, "image_prompt_tokens", {}).items()
        }
        before, after = (
            getattr(model, "image_prompt", "{image}").format(image="\0", **token_text).split("\0")
        )
        image_token_id = model.image_token_id
        return cls(
            getattr(model, "image_placeholder_id", image_token_id),
            image_token_id,
            before,
            after,
            getattr(model, "bidirectional_images", False),
        )


class MultiModalProcessor:
    """The image side of one vision-language model's input processing (thread-safe)."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        prompt: ImagePrompt,
        image_tokens: ImageTokens,
        config: MultiModalConfig,
    ):
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", **HF_OFFLINE_KWARGS
        )
        # Gemma 3's crops would each take their own image tokens: not served yet.
        require(
            not getattr(self.image_processor, "do_pan_and_scan", False),
            "model",
            str(model_dir),
            "its image processor sets do_pan_and_scan, not served yet",
        )
        self.prompt, self.image_tokens = prompt, image_tokens
        self.placeholder = tokenizer.convert_ids_to_tokens(prompt.placeholder_id)
        """The placeholder as text: what a text prompt holds, and error messages name."""
        self.image_text = tokenizer.convert_ids_to_tokens(prompt.image_token_id)
        # Token-id prompts: the wrapping text as tokenized alone (vLLM's way with token prompts).
        self._before = tokenizer(prompt.before, add_special_tokens=False)["input_ids"]
        self._after = tokenizer(prompt.after, add_special_tokens=False)["input_ids"]
        self.config = config
        check_processor_fits(self.image_processor, config.limits)

    def process_text(
        self, prompt: str, images: Sequence[DecodedImage], tokenize: Callable[[str], list[int]]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """A text prompt's token ids with its images' placeholders replaced as the checkpoint's
        processor replaces them in the text before tokenizing (so a wrapping that merges with
        the text around it tokenizes as transformers' does), and the images' features."""
        self._check_count(prompt.count(self.placeholder), images)
        datas = [self._preprocess(image) for image in images]
        counts = [self.image_tokens(d) for d in datas]
        pieces = prompt.split(self.placeholder)
        text = pieces[0]
        for count, piece in zip(counts, pieces[1:], strict=True):
            text += self.prompt.before + self.image_text * count + self.prompt.after + piece
        ids = tokenize(text)
        return ids, self._features(ids, images, datas, counts)

    def process_ids(
        self, ids: list[int], images: Sequence[DecodedImage]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """A token-id prompt's ids with each placeholder token replaced by its image's tokens
        (wrapped as the model's processor wraps them), and the images' features."""
        placeholders = [p for p, token in enumerate(ids) if token == self.prompt.placeholder_id]
        self._check_count(len(placeholders), images)
        datas = [self._preprocess(image) for image in images]
        counts = [self.image_tokens(d) for d in datas]
        out, previous = [], 0
        for place, count in zip(placeholders, counts, strict=True):
            out += ids[previous:place] + self._before
            out += [self.prompt.image_token_id] * count + self._after
            previous = place + 1
        out += ids[previous:]
        return out, self._features(out, images, datas, counts)

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt without images must not hold image placeholder tokens (they would be
        computed as text)."""
        if self.prompt.placeholder_id in ids or self.prompt.image_token_id in ids:
            raise InputError(
                f"the prompt holds image placeholders ({self.placeholder}) but no images"
            )

    def _check_count(self, placeholders: int, images: Sequence[DecodedImage]) -> None:
        if len(images) > self.config.max_images:
            raise InputError(
                f"the prompt has {len(images)} images; at most {self.config.max_images} are "
                "allowed (limit_mm_per_prompt)"
            )
        if placeholders != len(images):
            raise InputError(
                f"the prompt has {placeholders} image placeholders ({self.placeholder}) "
                f"for {len(images)} images: put one where each image goes"
            )

    def _features(
        self,
        ids: list[int],
        images: Sequence[DecodedImage],
        datas: list[dict[str, Any]],
        counts: list[int],
    ) -> list[MultiModalFeature]:
        """Each image's feature: the next `count` image tokens of `ids`, in order. InputError
        when the prompt holds image tokens of its own (they would take no image)."""
        image_id = self.prompt.image_token_id
        positions = [p for p, token in enumerate(ids) if token == image_id]
        if len(positions) != sum(counts):
            raise InputError(
                f"the prompt holds image tokens ({self.image_text}) of its own; put only "
                f"{self.placeholder} where each image goes"
            )
        features, taken = [], 0
        for image, data, count in zip(images, datas, counts, strict=True):
            offset = positions[taken]
            features.append(
                MultiModalFeature(image.digest, offset, count, data, self.prompt.bidirectional)
            )
            taken += count
        return features

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
    if getattr(model, "image_token_id", None) is None:
        return None
    for key, on in (
        ("enable_lora", config.enable_lora),
        ("speculative_config", config.speculative is not None),
    ):
        require(not on, key, getattr(config, key), "not served with images yet")
    settings = MultiModalConfig.of(config)
    prompt = ImagePrompt.of(model, tokenizer)
    if prompt.bidirectional:
        # An image is computed in one step, beside up to max_num_seqs - 1 decodes: a budget that
        # cannot hold both would leave an image prompt waiting while decodes keep arriving.
        tokens = model.max_image_tokens + config.max_num_seqs - 1
        require(
            config.max_num_batched_tokens >= tokens,
            "max_num_batched_tokens",
            config.max_num_batched_tokens,
            f"must be >= {tokens}: one image's {model.max_image_tokens} tokens (this model "
            "computes each image in one step) beside max_num_seqs - 1 decodes",
        )
    return MultiModalProcessor(model_dir, tokenizer, prompt, model.image_tokens, settings)
