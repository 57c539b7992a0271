"""Encoded test images, and the hostile ones the decoder must refuse."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encoded(width: int, height: int, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    """A `fmt` image of random pixels."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode).save(buffer, fmt)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 30000) -> bytes:
    """A PNG header declaring side x side RGB pixels with a few KB of zlib data: decoding it whole
    would take side^2 * 3 bytes (2.7 GB at 30000)."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 + side * 3) * 4, 9)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", rows)
        + _chunk(b"IEND", b"")
    )
