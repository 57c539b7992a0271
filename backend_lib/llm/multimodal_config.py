"""The image settings of the LLM (`limit_mm_per_prompt`, `max_image_pixels`, `max_image_bytes`,
`encoder_cache_size`), checked once; every error names its field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from backend_lib.config import ConfigError, require
from backend_lib.multimodal.images import ImageLimits

DEFAULT_IMAGES_PER_PROMPT = 8
"""Images one prompt may hold when `limit_mm_per_prompt` does not say."""


class MultiModalSettings(Protocol):
    """The LLMConfig fields read here."""

    limit_mm_per_prompt: str
    max_image_pixels: int
    max_image_bytes: int
    encoder_cache_size: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class MultiModalConfig:
    """The resolved image settings."""

    max_images: int
    """Images a prompt may hold (`limit_mm_per_prompt`'s "image")."""
    limits: ImageLimits
    """What one image may be (bytes, pixels)."""
    encoder_cache_size: int
    """Encoder output rows (placeholder tokens) the encoder cache keeps."""

    @classmethod
    def of(cls, settings: MultiModalSettings) -> MultiModalConfig:
        return cls(
            _max_images(settings.limit_mm_per_prompt),
            _limits(settings),
            _encoder_cache_size(settings),
        )


def _max_images(value: str) -> int:
    """vLLM's form: a JSON object of modality -> count, e.g. {"image": 4}; "" the default."""
    if not value.strip():
        return DEFAULT_IMAGES_PER_PROMPT
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError("limit_mm_per_prompt", value, f"not JSON: {exc.msg}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ConfigError(
            "limit_mm_per_prompt",
            value,
            'expected a JSON object with "image" only, e.g. {"image": 4}',
        )
    count = limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
    require(
        isinstance(count, int) and not isinstance(count, bool) and count >= 0,
        "limit_mm_per_prompt",
        value,
        '"image" must be an integer >= 0',
    )
    return count


def _limits(settings: MultiModalSettings) -> ImageLimits:
    for key in ("max_image_pixels", "max_image_bytes"):
        require(getattr(settings, key) >= 1, key, getattr(settings, key), "must be >= 1")
    return ImageLimits(settings.max_image_bytes, settings.max_image_pixels)


def _encoder_cache_size(settings: MultiModalSettings) -> int:
    size = settings.encoder_cache_size
    require(size >= 0, "encoder_cache_size", size, "must be >= 0 (0: auto)")
    return size or max(settings.max_num_batched_tokens, 8192)
