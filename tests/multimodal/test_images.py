"""Bounded image decoding: the formats served decode to the same pixels Pillow gives; every kind
of bad image is refused with an InputError that names what is wrong, before its pixels are
allocated where the header already says too much."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from backend_lib.errors import InputError
from backend_lib.multimodal.images import ImageLimits, decode_image, image_digest
from tests.multimodal.image_helpers import encoded, png_bomb


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_lossless_formats_decode_to_the_encoded_pixels(fmt):
    data = encoded(37, 23, fmt, seed=1)
    decoded = decode_image(data, ImageLimits())
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert decoded.size == (37, 23) and decoded.image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(decoded.image), expected)
    assert decoded.digest == image_digest(data) and len(decoded.digest) == 32


def test_jpeg_grey_and_alpha_images_become_rgb():
    for data in (
        encoded(16, 8, "JPEG"),
        encoded(16, 8, "PNG", mode="L"),
        encoded(16, 8, mode="RGBA"),
    ):
        assert decode_image(data, ImageLimits()).image.mode == "RGB"


def test_digest_tells_images_apart():
    first, second = encoded(8, 8, seed=1), encoded(8, 8, seed=2)
    assert decode_image(first, ImageLimits()).digest != decode_image(second, ImageLimits()).digest


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (encoded(64, 64)[:100], "truncated or corrupt"),
        (b"GIF89a" + b"\0" * 32, "not a PNG, JPEG or WebP"),
        (encoded(8, 8, "GIF"), "not a PNG, JPEG or WebP"),
        (encoded(8, 8, "BMP"), "not a PNG, JPEG or WebP"),
        (b"not an image at all", "not a PNG, JPEG or WebP"),
    ],
    ids=["empty", "truncated-png", "gif-header", "gif", "bmp", "text"],
)
def test_bad_images_are_refused(data, message):
    with pytest.raises(InputError, match=message):
        decode_image(data, ImageLimits())


def test_limits_name_their_setting():
    data = encoded(100, 50)
    with pytest.raises(InputError, match=r"100x50 = 5000 pixels.*max_image_pixels"):
        decode_image(data, ImageLimits(max_image_pixels=4999))
    assert decode_image(data, ImageLimits(max_image_pixels=5000)).size == (100, 50)
    with pytest.raises(InputError, match="max_image_bytes"):
        decode_image(data, ImageLimits(max_image_bytes=len(data) - 1))


@pytest.mark.parametrize("max_pixels", [4096 * 4096, 10**10])
def test_a_decompression_bomb_is_refused_without_decoding_it(max_pixels):
    bomb = png_bomb(30000)
    assert len(bomb) < 16 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="pixels"):
            decode_image(bomb, ImageLimits(max_image_pixels=max_pixels))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20  # nothing near the 2.7 GB the pixels would take


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("limit_mm_per_prompt", "{image: 2}", "not JSON"),
        ("limit_mm_per_prompt", '{"video": 1}', '"image" only'),
        ("limit_mm_per_prompt", '{"image": -1}', "integer >= 0"),
        ("max_image_pixels", 0, "must be >= 1"),
        ("max_image_bytes", 0, "must be >= 1"),
        ("encoder_cache_size", -1, "must be >= 0"),
    ],
)
def test_llm_image_settings_are_checked_naming_the_field(field, value, message):
    from backend_lib.config import ConfigError
    from backend_lib.llm.config import LLMConfig

    with pytest.raises(ConfigError, match=rf"{field}.*{message}"):
        LLMConfig(model="m", **{field: value}).validate()


def test_frontend_media_directory_must_exist(tmp_path):
    from openai_frontend.config import FrontendConfig, FrontendConfigError

    with pytest.raises(FrontendConfigError, match="allowed_local_media_path.*not a directory"):
        FrontendConfig(allowed_local_media_path=tmp_path / "missing")
    assert (
        FrontendConfig(allowed_local_media_path=tmp_path).image_fetch_policy().local_dir == tmp_path
    )
