"""What the GPTQ and AWQ formats (gptq.py, awq.py) share: each quantized module stores int32 words
of packed 4- or 8-bit values (`qweight`, `qzeros`) and float16 `scales`, converted into the
`wna16` staging tensors (scheme.py); the regrouping per module is format.py's."""

from __future__ import annotations

import torch

from backend_lib.llm.execution.checkpoint_quantization.format import QuantizedFormat
from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    WeightScheme,
)

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
"""Tensor suffixes of a GPTQ or AWQ quantized module besides `bias`."""


class PackedIntFormat(QuantizedFormat):
    """GPTQ's and AWQ's common stored parts."""

    QUANT_SUFFIXES = QUANT_SUFFIXES


def int_scheme(bits: int, group_size: int, symmetric: bool) -> WeightScheme:
    """A weight-only int scheme; `group_size` -1 is per channel."""
    return WeightScheme(
        type="int",
        num_bits=bits,
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size,
        symmetric=symmetric,
        dynamic_activations=False,
    )


def unpack_last_dim(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [..., W] holding `32 // bits` values each, value j of a word in its bits
    [j * bits, +bits), unsigned -> int64 [..., count] (count <= W * 32 // bits)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    values = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count]


def expect_scales(name: str, scales: torch.Tensor, groups: int, n: int) -> torch.Tensor:
    """Stored scales [groups, n] (any float dtype) -> staging scales float32 [n, groups]."""
    if not scales.is_floating_point() or tuple(scales.shape) != (groups, n):
        raise CheckpointFormatError(
            f"{name} is {scales.dtype} {list(scales.shape)}, expected a float dtype {[groups, n]}"
        )
    return scales.float().T.contiguous()


def check_divides(module: str, k: int, group: int, bits: int) -> None:
    if k % group or group % (32 // bits):
        raise CheckpointFormatError(
            f"{module}: group size {group} does not divide in_features {k} in whole int32 words "
            f"of {bits}-bit values"
        )
