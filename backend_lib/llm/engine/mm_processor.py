"""A vision-language model's prompt processing: prompt text with image placeholders, and decoded
images, in; token ids with each placeholder expanded to its image's tokens, and one
`MultiModalFeature` per image, out.

The checkpoint's own transformers processor does the work (its image processor config: resize,
crop, normalisation; its placeholder expansion), so the prompt the model sees is the one
transformers' `generate` sees. Runs on the caller's thread (input_processor.py); every problem is
an InputError for that request.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import transformers

from backend_lib.errors import InputError
from backend_lib.llm.core.multimodal import MultiModalFeature
from backend_lib.llm.multimodal_config import MultiModalConfig
from backend_lib.multimodal.images import DecodedImage
from backend_lib.multimodal.resize import check_processor_fits, check_resized


class MultiModalProcessor:
    """The image side of one vision-language model's input processing (thread-safe)."""

    def __init__(self, model_dir: Path, image_token_id: int, config: MultiModalConfig):
        self.processor = transformers.AutoProcessor.from_pretrained(
            model_dir, local_files_only=True
        )
        self.image_token_id = image_token_id
        self.image_token = self.processor.tokenizer.convert_ids_to_tokens(image_token_id)
        self.config = config
        check_processor_fits(self.processor.image_processor, config.limits)
        self._lock = threading.Lock()  # the processor's tokenizer is not reentrant

    def process(
        self, prompt: str, images: Sequence[DecodedImage]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Token ids of `prompt` with its images' placeholders expanded, and the images' features
        in prompt order."""
        if len(images) > self.config.max_images:
            raise InputError(
                f"the prompt has {len(images)} images; at most {self.config.max_images} are "
                "allowed (limit_mm_per_prompt)"
            )
        pictures = [image.image for image in images]
        for picture in pictures:
            check_resized(self.processor.image_processor, *picture.size, self.config.limits)
        try:
            with self._lock:
                encoded = self.processor(
                    text=[prompt], images=pictures or None, return_tensors="pt"
                )
                sizes = [(p.height, p.width) for p in pictures]
                counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes)
        except (ValueError, TypeError) as exc:
            raise InputError(f"the prompt and its images do not match: {exc}") from None
        ids = encoded["input_ids"][0].tolist()
        offsets = self._offsets(ids, counts.num_image_tokens)
        features = [
            MultiModalFeature(
                image.digest, offset, length, {"pixel_values": encoded["pixel_values"][i : i + 1]}
            )
            for i, (image, offset, length) in enumerate(
                zip(images, offsets, counts.num_image_tokens, strict=True)
            )
        ]
        return ids, features

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt without images must not hold image placeholder tokens (they would be
        computed as text)."""
        if self.image_token_id in ids:
            raise InputError(
                f"the prompt holds image placeholders ({self.image_token}) but no images"
            )

    def _offsets(self, ids: list[int], lengths: list[int]) -> list[int]:
        """Where each image's run of placeholder tokens starts."""
        positions = [p for p, token in enumerate(ids) if token == self.image_token_id]
        if len(positions) != sum(lengths):
            raise InputError(
                f"the prompt has {len(positions)} image placeholder tokens where its "
                f"{len(lengths)} images take {sum(lengths)} (one {self.image_token} per image)"
            )
        offsets, cursor = [], 0
        for length in lengths:
            run = positions[cursor : cursor + length]
            if run[-1] - run[0] != length - 1:
                raise InputError(f"an image's {length} placeholder tokens are not consecutive")
            offsets.append(run[0])
            cursor += length
        return offsets
