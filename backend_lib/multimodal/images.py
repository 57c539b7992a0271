"""Bounded image decoding: encoded bytes in, a loaded RGB picture out, or an `InputError` that says
what is wrong with that caller's image.

Every limit is checked before the pixels are decoded: the byte size first, then the format and
the width x height Pillow reads from the header, so a decompression bomb (a few KB of PNG that
inflate to gigapixels) is refused without allocating its pixels. Truncated or corrupt data fails
when the pixels are read, and only that request fails.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from backend_lib.errors import InputError

FORMATS = ("PNG", "JPEG", "WEBP")
"""The encoded formats accepted (Pillow's format names)."""

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be.

    - `max_image_bytes`: size of the encoded image, bytes.
    - `max_image_pixels`: width x height, pixels, read from the header before decoding.
    """

    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class DecodedImage:
    """One decoded image.

    - `image`: the pixels, loaded, mode RGB (alpha dropped, palettes expanded).
    - `digest`: SHA-256 of the encoded bytes, 32 bytes: what prefix-cache hashes and the encoder
      cache key an image by, so two different images never share either.
    """

    image: Image.Image
    digest: bytes

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.image.size


def image_digest(data: bytes) -> bytes:
    """The 32-byte SHA-256 of an encoded image (`DecodedImage.digest`)."""
    return hashlib.sha256(data).digest()


def decode_image(data: bytes, limits: ImageLimits) -> DecodedImage:
    """Decode one PNG, JPEG or WebP image within `limits`; the first frame of an animated one.

    Raises `InputError` for an empty, oversized, unrecognised, unsupported, too-large-in-pixels,
    truncated or corrupt image.
    """
    if not data:
        raise InputError("the image is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise InputError(
            f"the image is {len(data)} bytes; the limit is {limits.max_image_bytes} "
            "(max_image_bytes)"
        )
    picture = _open_header(data)
    _check_header(picture, limits)
    return DecodedImage(_load_rgb(picture), image_digest(data))


def _open_header(data: bytes) -> Image.Image:
    """Pillow's lazy image: format and size from the header, no pixels decoded yet. (Pillow's own
    bomb check refuses past twice its `MAX_IMAGE_PIXELS`, 179M pixels, whatever ours says.)"""
    try:
        with warnings.catch_warnings():
            # Our own pixel limit is the guard; Pillow's global bomb check must not turn into a
            # process-wide setting or a warning on the server's log.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Only the accepted formats' parsers ever see the bytes.
            return Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise InputError(
            "the image is not a PNG, JPEG or WebP file (the supported formats)"
        ) from None
    except Image.DecompressionBombError as exc:
        raise InputError(f"the image is a decompression bomb: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"the image cannot be read: {exc}") from None


def _check_header(picture: Image.Image, limits: ImageLimits) -> None:
    if picture.format not in FORMATS:
        raise InputError(
            f"the image format {picture.format} is not supported; supported: {', '.join(FORMATS)}"
        )
    width, height = picture.size
    if width < 1 or height < 1:
        raise InputError(f"the image is {width}x{height} pixels: empty")
    if width * height > limits.max_image_pixels:
        raise InputError(
            f"the image is {width}x{height} = {width * height} pixels; the limit is "
            f"{limits.max_image_pixels} (max_image_pixels)"
        )


def _load_rgb(picture: Image.Image) -> Image.Image:
    """Decode the pixels (the first frame) and convert them to RGB."""
    try:
        picture.load()
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InputError(f"the image is truncated or corrupt: {exc}") from None
    return picture if picture.mode == "RGB" else picture.convert("RGB")
