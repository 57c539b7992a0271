"""GGUF's quantized tensors as this engine stores them once converted (`quant_method: gguf`,
written by backend_lib/gguf_checkpoint.py): each projection's llama.cpp blocks decoded, exactly,
into the WNA16 staging layout (scheme.py) and saved under the module's name:

- `weight_packed` int32 [N, K * bits / 32]: the stored values u, unsigned (kernels/wna16_linear.py's
  packing); 5- and 6-bit values (Q5_K, Q6_K) in 8-bit containers;
- `weight_scale` float32 [N, K / group], `weight_zero` uint8 [N, K / group], and for the types
  with float minimums (Q4_1, Q4_K, Q5_K) `weight_min` float32 [N, K / group];

so that w = (u - zero) * scale - min, in float32, is bit for bit what `gguf.quants.dequantize`
computes. `quantization_config.layers` gives each module's bits, group size, whether it has
minimums, and the GGUF types it came from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from backend_lib.llm.execution.checkpoint_quantization.format import QuantizedFormat, expect
from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    LayerShape,
    WeightScheme,
)

METHOD = "gguf"


class GGUFFormat(QuantizedFormat):
    """A converted GGUF checkpoint's `quantization_config` (module docstring)."""

    method = METHOD
    QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero", "weight_min")

    def __init__(self, quantization_config: Mapping[str, Any]):
        layers = quantization_config.get("layers")
        if not isinstance(layers, Mapping) or not layers:
            raise CheckpointFormatError("gguf quantization_config has no `layers`")
        self.schemes = {module: _scheme(module, spec) for module, spec in layers.items()}
        self.types = {
            module: tuple(spec.get("tensor_types", ())) for module, spec in layers.items()
        }

    def describe(self) -> str:
        """E.g. "gguf W4A16 group 32 asymmetric with float minimums (Q4_K)"."""
        by_scheme: dict[str, set[str]] = {}
        for module, scheme in self.schemes.items():
            by_scheme.setdefault(scheme.describe(), set()).update(self.types[module])
        parts = [f"{d} ({', '.join(sorted(t))})" for d, t in sorted(by_scheme.items())]
        return f"{METHOD} {'; '.join(parts)}"

    def scheme_for(self, module: str) -> WeightScheme | None:
        return self.schemes.get(module)

    def required(self, module: str, layer: LayerShape) -> frozenset[str]:
        names = {"weight_packed", "weight_scale", "weight_zero"}
        return frozenset(names | {"weight_min"} if layer.scheme.float_mins else names)

    def staging(
        self, module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scheme, n, k = layer.scheme, layer.out_features, layer.in_features
        groups = k // scheme.group_size_for(k)
        packed = (n, k * scheme.num_bits // 32)
        expect(f"{module}.weight_packed", parts["weight_packed"], packed, torch.int32)
        expect(f"{module}.weight_scale", parts["weight_scale"], (n, groups), torch.float32)
        expect(f"{module}.weight_zero", parts["weight_zero"], (n, groups), torch.uint8)
        yield f"{module}.qweight", parts["weight_packed"]
        yield f"{module}.scales", parts["weight_scale"]
        yield f"{module}.zeros", parts["weight_zero"]
        if scheme.float_mins:
            expect(f"{module}.weight_min", parts["weight_min"], (n, groups), torch.float32)
            yield f"{module}.mins", parts["weight_min"]


def _scheme(module: str, spec: Any) -> WeightScheme:
    """One layer's entry as a WeightScheme; CheckpointFormatError naming the module otherwise."""
    try:
        bits, group, mins = int(spec["bits"]), int(spec["group_size"]), bool(spec["float_mins"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointFormatError(
            f"gguf quantization_config.layers[{module!r}] needs bits, group_size and float_mins"
        ) from None
    if bits not in (4, 8) or group <= 0:
        raise CheckpointFormatError(f"gguf layer {module!r}: bits {bits}, group {group}")
    return WeightScheme("int", bits, "group", group, False, False, float_mins=mins)
