"""How a pre-quantized checkpoint stores one linear layer, and the tensors the engine loads it into.

A checkpoint format (compressed_tensors.py) reads its own `quantization_config` into a
`WeightScheme` per layer and converts the layer's stored tensors into the engine's **staging
tensors**, one layout per `StagingKind`. Every staging tensor is indexed by output row first, so a
fused projection (q/k/v, gate/up) is filled shard by shard along dim 0 exactly as float weights are
(`LlamaForCausalLM.load_weights`). After loading, layers.py turns the staging tensors into the
layer that computes (`finalize_quantized_layers`).

Staging tensors of a linear with N outputs and K inputs:

- `wna16` (int weights, 4 or 8 bits, 16/32-bit activations):
  `qweight` int32 [N, K * bits / 32] (element k of a row: bits [(k * bits) % 32, +bits) of word
  (k * bits) // 32, unsigned u in [0, 2^bits)), `scales` float32 [N, K / group_size],
  `zeros` uint8 [N, K / group_size] in the same unsigned domain, and with float minimums
  (`WeightScheme.float_mins`: GGUF's Q4_1 and K-quants) `mins` float32 [N, K / group_size];
  w = (u - zero) * scale (- min) (kernels/wna16_linear.py).
- `int8_dynamic` (W8A8: symmetric int8 weights, int8 activations quantized per token at run time):
  `qweight` int8 [N, K], `scales` float32 [N, 1].
- `fp8` (float8_e4m3fn weights, activations in the model dtype or fp8 per token at run time):
  `qweight` float8_e4m3fn [N, K], `scales` float32 [N, 1].

Scales are held in float32 whatever the checkpoint's dtype: bfloat16 and float16 convert exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StagingKind = Literal["wna16", "int8_dynamic", "fp8"]


@dataclass(frozen=True)
class WeightScheme:
    """One linear layer's stored quantization (the checkpoint format's terms, normalised)."""

    type: Literal["int", "float"]
    num_bits: int
    strategy: Literal["tensor", "channel", "group"]
    """Scale granularity: one per tensor, per output row, or per `group_size` inputs of a row."""
    group_size: int | None
    """Inputs sharing a scale (group strategy only)."""
    symmetric: bool
    """False: the checkpoint stores zero points."""
    dynamic_activations: bool
    """True: activations are quantized per token at run time (W8A8, FP8 dynamic); False: they stay
    in the model dtype (weight-only)."""
    float_mins: bool = False
    """A float minimum per group is subtracted after scaling (int weights only)."""

    @property
    def kind(self) -> StagingKind:
        """The staging layout (module docstring) this scheme loads into."""
        if self.type == "float":
            return "fp8"
        return "int8_dynamic" if self.dynamic_activations else "wna16"

    def group_size_for(self, in_features: int) -> int:
        """Inputs per scale for a layer with `in_features` inputs."""
        return self.group_size if self.strategy == "group" else in_features

    def describe(self) -> str:
        """E.g. "W4A16 group 128 asymmetric", for messages and the model's facts."""
        acts = "8" if self.dynamic_activations else "16"
        weights = f"W{self.num_bits}A{acts}" if self.type == "int" else f"FP8 (A{acts})"
        detail = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        zero = "symmetric" if self.symmetric else "asymmetric"
        return f"{weights} {detail} {zero}" + (" with float minimums" if self.float_mins else "")


@dataclass(frozen=True)
class LayerShape:
    """A quantized checkpoint layer as the engine expects it."""

    scheme: WeightScheme
    out_features: int
    in_features: int


class CheckpointFormatError(ValueError):
    """A quantization_config this engine cannot serve, or stored tensors that contradict it."""
