"""AWQ checkpoints (`quant_method: awq`, `version: gemm`: AutoAWQ, GPTQModel's AWQ, llm-compressor's
older exports) — the layout AutoAWQ's `WQLinear_GEMM` stores and vLLM's AWQ kernels read.

Per quantized module, with K inputs, N outputs and G = K / group_size groups (4 bits, zero
points):

- `qweight` int32 [K, N / 8], packed along N in AWQ's interleaved order: value i of a word (bits
  [4i, 4i + 4)) is output 8j + [0, 2, 4, 6, 1, 3, 5, 7][i] of word j; unsigned u in [0, 16).
- `qzeros` int32 [G, N / 8], packed the same way; zero points z in [0, 16), no offset.
- `scales` float16 [G, N]. w = (u - z) * s (AutoAWQ's `dequantize_gemm`).

They are unpacked, put in output order and repacked along K into the `wna16` staging layout.
Modules whose name contains an entry of `modules_to_not_convert` stay in full precision, as
AutoAWQ and transformers skip them. Refused, named: other versions (gemv, gemv_fast, marlin,
ipex, ...), other bits, `zero_point: false`, llm-awq's packing (`backend: llm-awq`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from backend_lib.llm.execution.checkpoint_quantization.format import expect
from backend_lib.llm.execution.checkpoint_quantization.packed_int import (
    PackedIntFormat,
    check_divides,
    expect_scales,
    int_scheme,
    unpack_last_dim,
)
from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    LayerShape,
    WeightScheme,
)
from kernels import wna16_linear as wna16

METHOD = "awq"
VERSIONS = ("gemm",)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The output offset (within its word's 8) of value i of a packed AWQ word."""
_REQUIRED = frozenset({"qweight", "qzeros", "scales"})


class AWQFormat(PackedIntFormat):
    """A parsed AWQ `quantization_config` and the conversion of its layers into `wna16` staging
    tensors."""

    method = METHOD

    def __init__(self, quantization_config: Mapping[str, Any]):
        config = dict(quantization_config)
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        if version not in VERSIONS:
            raise CheckpointFormatError(
                f"AWQ version {version!r} is not supported; supported: {', '.join(VERSIONS)}"
            )
        self.version = version
        if str(config.get("backend") or "autoawq").lower() == "llm-awq":
            raise CheckpointFormatError("AWQ backend 'llm-awq' (its packing) is not supported")
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise CheckpointFormatError(f"AWQ bits {bits!r} is not supported; supported: 4")
        if not config.get("zero_point", True):
            raise CheckpointFormatError(
                "AWQ zero_point false is not supported (GEMM checkpoints store zero points)"
            )
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or group <= 0:
            raise CheckpointFormatError(f"AWQ group_size {group!r} is not supported")
        self.scheme = int_scheme(4, group, symmetric=False)
        self.modules_to_not_convert = tuple(config.get("modules_to_not_convert") or ())

    def describe(self) -> str:
        """E.g. "awq W4A16 group 128 asymmetric, version gemm"."""
        return f"{METHOD} {self.scheme.describe()}, version {self.version}"

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The layers' one scheme; None for a module named in `modules_to_not_convert`."""
        if any(skipped in module for skipped in self.modules_to_not_convert):
            return None
        return self.scheme

    def required(self, module: str, layer: LayerShape) -> frozenset[str]:
        return _REQUIRED

    def staging(
        self, module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        n, k = layer.out_features, layer.in_features
        group = layer.scheme.group_size_for(k)
        if n % 8:
            raise CheckpointFormatError(
                f"{module}: out_features {n} is not a multiple of 8 (AWQ packs 8 outputs a word)"
            )
        check_divides(module, k, group, 4)
        groups = k // group
        expect(f"{module}.qweight", parts["qweight"], (k, n // 8), torch.int32)
        expect(f"{module}.qzeros", parts["qzeros"], (groups, n // 8), torch.int32)
        scales = expect_scales(f"{module}.scales", parts["scales"], groups, n)
        u = _unpack_awq(parts["qweight"])  # [K, N]
        yield f"{module}.qweight", wna16.pack_wna16(u.T.contiguous(), 4)
        yield f"{module}.scales", scales
        yield f"{module}.zeros", _unpack_awq(parts["qzeros"]).T.to(torch.uint8).contiguous()


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, N / 8] -> their values int64 [R, N] in output order."""
    values = unpack_last_dim(words, 4, words.shape[1] * 8).view(words.shape[0], -1, 8)
    ordered = torch.empty_like(values)
    ordered[..., list(AWQ_ORDER)] = values
    return ordered.view(words.shape[0], -1)
