"""llama.cpp's quantized blocks decoded into the WNA16 layer's terms (kernels/wna16_linear.py):
unsigned values u, and per group a float32 scale, a uint8 zero point and, for the types that have
one, a float32 minimum, so that (u - zero) * scale - minimum in float32 is bit for bit what
`gguf.quants.dequantize` computes (its products are the same float32 operations).

| type | block | bits (container) | group | zero | minimum |
|---|---|---|---|---|---|
| Q8_0 | d, 32 int8 | 8 | 32 | 128 | - |
| Q4_0 | d, 32 nibbles | 4 | 32 | 8 | - |
| Q4_1 | d, m, 32 nibbles | 4 | 32 | 0 | -m |
| Q5_0 | d, 32 high bits, 32 nibbles | 5 (8) | 32 | 16 | - |
| Q5_1 | d, m, 32 high bits, 32 nibbles | 5 (8) | 32 | 0 | -m |
| Q4_K | 256: d, dmin, 8 x 6-bit (scale, min), nibbles | 4 | 32 | 0 | dmin * min |
| Q5_K | 256: as Q4_K plus a high bit per value | 5 (8) | 32 | 0 | dmin * min |
| Q6_K | 256: 16 int8 scales, d, 6-bit values | 6 (8) | 16 | 32 | - |

Scales of the K-quants are d times the sub-block's scale, in float32, as gguf computes them.
`harmonize` brings layers that the engine fuses into one projection to one layout (the widest
container, the smallest group, minimums where any has them) without changing a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf.quants import Q4_K

BLOCK_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
"""Bytes per block of each type this engine loads as stored."""


@dataclass(frozen=True)
class DecodedWeight:
    """A quantized [N, K] weight in the WNA16 layer's terms (module docstring)."""

    bits: int
    """The container: 4 or 8."""
    group_size: int
    values: np.ndarray
    """uint8 [N, K]: u."""
    scales: np.ndarray
    """float32 [N, K / group_size]."""
    zeros: np.ndarray
    """uint8 [N, K / group_size]."""
    mins: np.ndarray | None
    """float32 [N, K / group_size], or None (no minimum)."""
    tensor_types: tuple[str, ...]
    """The GGUF types it was decoded from."""

    def dequantized(self) -> np.ndarray:
        """float32 [N, K]: (u - zero) * scale - minimum."""
        n, k = self.values.shape
        u = self.values.astype(np.float32).reshape(n, -1, self.group_size)
        w = (u - self.zeros.astype(np.float32)[..., None]) * self.scales[..., None]
        if self.mins is not None:
            w = w - self.mins[..., None]
        return w.reshape(n, k)

    def regrouped(self, bits: int, group_size: int, with_mins: bool) -> DecodedWeight:
        """The same weight in a wider container, smaller groups, or with (zero) minimums."""
        repeat = self.group_size // group_size
        mins = self.mins
        if with_mins and mins is None:
            mins = np.zeros_like(self.scales)
        return DecodedWeight(
            bits,
            group_size,
            self.values,
            np.repeat(self.scales, repeat, axis=1),
            np.repeat(self.zeros, repeat, axis=1),
            None if mins is None else np.repeat(mins, repeat, axis=1),
            self.tensor_types,
        )


def decode(kind: str, data: np.ndarray) -> DecodedWeight:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of type `kind` (BLOCK_BYTES)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES[kind])
    bits, group, values, scales, zeros, mins = _DECODERS[kind](blocks)
    groups = scales.size // rows
    return DecodedWeight(
        bits,
        group,
        values.reshape(rows, -1).astype(np.uint8),
        scales.reshape(rows, groups).astype(np.float32),
        np.broadcast_to(np.uint8(zeros), (rows, groups)).copy(),
        None if mins is None else mins.reshape(rows, groups).astype(np.float32),
        (kind,),
    )


def harmonize(weights: list[DecodedWeight]) -> list[DecodedWeight]:
    """`weights` in one layout (module docstring); unchanged when they share one already."""
    bits = max(w.bits for w in weights)
    group = math.gcd(*(w.group_size for w in weights))
    with_mins = any(w.mins is not None for w in weights)
    return [
        w
        if (w.bits, w.group_size, w.mins is not None) == (bits, group, with_mins)
        else w.regrouped(bits, group, with_mins)
        for w in weights
    ]


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 stored as 2 bytes (the last axis) -> float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16 j] -> values [..., 32 j]: low nibbles first, then high, per run of bytes."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(blocks: np.ndarray):
    values = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return 8, 32, values, _f16(blocks[:, :2]), 128, None


def _q4_0(blocks: np.ndarray):
    return 4, 32, _nibbles(blocks[:, 2:]), _f16(blocks[:, :2]), 8, None


def _q4_1(blocks: np.ndarray):
    return 4, 32, _nibbles(blocks[:, 4:]), _f16(blocks[:, :2]), 0, -_f16(blocks[:, 2:4])


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: 4 bytes of high bits (bit i: value i) over 16 bytes of nibbles."""
    high = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)[None, :]
    return _nibbles(qs) | ((high & 1).astype(np.uint8) << 4)


def _q5_0(blocks: np.ndarray):
    return 8, 32, _five_bits(blocks[:, 2:6], blocks[:, 6:]), _f16(blocks[:, :2]), 16, None


def _q5_1(blocks: np.ndarray):
    values = _five_bits(blocks[:, 4:8], blocks[:, 8:])
    return 8, 32, values, _f16(blocks[:, :2]), 0, -_f16(blocks[:, 2:4])


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per sub-block of 32, d * scale and dmin * min, [blocks, 8] float32."""
    d, dmin = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
    scale, minimum = Q4_K.get_scale_min(blocks[:, 4:16])
    return d * scale.astype(np.float32), dmin * minimum.astype(np.float32)


def _q4_k(blocks: np.ndarray):
    scales, mins = _k_scales(blocks)
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # sub-blocks 2j (low nibbles) and 2j + 1 (high)
    values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return 4, 32, values, scales, 0, mins


def _q5_k(blocks: np.ndarray):
    scales, mins = _k_scales(blocks)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qs = blocks[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    values = (low | ((qh & 0x01) << 4)).reshape(-1, 256)
    return 8, 32, values, scales, 0, mins


def _q6_k(blocks: np.ndarray):
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    qh = qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    values = ((ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x03).reshape(-1, 8, 32) << 4)).reshape(
        -1, 256
    )
    scales = _f16(blocks[:, 208:])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return 8, 16, values, scales, 32, None


_DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
