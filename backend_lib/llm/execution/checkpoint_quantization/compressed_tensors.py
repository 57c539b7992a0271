"""compressed-tensors checkpoints (llm-compressor's format, `quant_method: compressed-tensors`).

The `quantization_config` is parsed by the compressed-tensors library itself (its pydantic
`QuantizationConfig`) and its target and ignore patterns are matched with its own `match_name`.
Supported storage formats, per config group:

- `pack-quantized`: int weights of 4 or 8 bits packed into int32 (`weight_packed` [N, K*bits/32],
  values offset by 2^(bits-1) so they are unsigned), `weight_scale` [N, K/group] (group) or [N, 1]
  (channel), `weight_shape` [2], and for asymmetric schemes `weight_zero_point`, signed and packed
  along the output dim [N*bits/32, K/group]. Weight-only (A16).
- `int-quantized`: int8 `weight` [N, K] with per-channel (or per-tensor) symmetric scales, int8
  activations quantized per token at run time (W8A8 dynamic).
- `float-quantized`: float8_e4m3fn `weight` [N, K] with per-channel (or per-tensor) scales,
  activations in the model dtype or dynamic per-token fp8.

Layers listed in `ignore` (or matched by no group) load as full-precision weights. Anything else
(other formats, static activation scales, block or token weight strategies, a kv-cache scheme) is
refused at load with an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from backend_lib.llm.execution.checkpoint_quantization.format import QuantizedFormat, expect
from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    LayerShape,
    WeightScheme,
)

METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")

# Every tensor suffix a compressed-tensors module may store besides `weight` and `bias`.
_QUANT_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "k_scale",
    "v_scale",
)


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    format: str
    scheme: WeightScheme


class CompressedTensorsFormat(QuantizedFormat):
    """A parsed compressed-tensors `quantization_config`: each layer's scheme, and the conversion of
    its stored tensors into the engine's staging tensors (scheme.py)."""

    method = METHOD
    QUANT_SUFFIXES = _QUANT_SUFFIXES

    def __init__(self, quantization_config: Mapping[str, Any]):
        # Imported on load, not at start (docs/architecture.md, import rules).
        from compressed_tensors.quantization import QuantizationConfig

        try:
            config = QuantizationConfig.model_validate(dict(quantization_config))
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise CheckpointFormatError(
                f"invalid compressed-tensors quantization_config: {e}"
            ) from e
        if config.kv_cache_scheme is not None:
            raise CheckpointFormatError(
                "the checkpoint quantizes the KV cache (kv_cache_scheme); this engine does not "
                "read checkpoint KV scales (set kv_cache_dtype instead)"
            )
        self.ignore: tuple[str, ...] = tuple(config.ignore or ())
        self.groups = tuple(
            _parse_group(name, group, config.format) for name, group in config.config_groups.items()
        )
        self._formats = {g.scheme: g.format for g in self.groups}

    def describe(self) -> str:
        """E.g. "compressed-tensors pack-quantized W4A16 group 128 symmetric"."""
        parts = sorted({f"{g.format} {g.scheme.describe()}" for g in self.groups})
        return f"{METHOD} {', '.join(parts)}"

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme checkpoint module `module` (e.g. "model.layers.0.self_attn.q_proj") is
        stored in; None when it is ignored or matched by no group. As compressed-tensors matches,
        an exact name wins over a regex, and a regex over a class; the `Linear` class matches
        every module asked about (the engine asks only about its linear layers)."""
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        for precedence in (_exact, _regex, _linear):
            for group in self.groups:
                if any(precedence(module, target) for target in group.targets):
                    return group.scheme
        return None

    def required(self, module: str, layer: LayerShape) -> frozenset[str]:
        if self._formats[layer.scheme] == "pack-quantized":
            names = {"weight_packed", "weight_scale", "weight_shape"}
            return frozenset(names if layer.scheme.symmetric else names | {"weight_zero_point"})
        return frozenset({"weight", "weight_scale"})

    def staging(
        self, module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if self._formats[layer.scheme] == "pack-quantized":
            return _packed_staging(module, layer, parts)
        return _unpacked_staging(module, self._formats[layer.scheme], layer, parts)


def _matches(module: str, target: str) -> bool:
    from compressed_tensors.utils.match import match_name

    return _linear(module, target) or match_name(module, target)


def _exact(module: str, target: str) -> bool:
    return target == module


def _regex(module: str, target: str) -> bool:
    from compressed_tensors.utils.match import match_name

    return target.startswith("re:") and match_name(module, target)


def _linear(_module: str, target: str) -> bool:
    return target == "Linear"


def _parse_group(name: str, group: Any, default_format: str) -> _Group:
    """One config group as a WeightScheme, or CheckpointFormatError naming what is unsupported."""
    if isinstance(group, list):
        raise CheckpointFormatError(
            f"config group {name!r} names a preset scheme ({group}); expected explicit weights"
        )
    fmt = str(getattr(group.format, "value", group.format) or default_format)
    where = f"config group {name!r}"
    if fmt not in SUPPORTED_FORMATS:
        raise CheckpointFormatError(
            f"{where}: format {fmt!r} is not supported; supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    w, a = group.weights, group.input_activations
    if w is None:
        raise CheckpointFormatError(f"{where} quantizes no weights")
    if group.output_activations is not None:
        raise CheckpointFormatError(f"{where}: output activation quantization is not supported")
    if w.dynamic:
        raise CheckpointFormatError(f"{where}: dynamic weight quantization is not supported")
    scheme = WeightScheme(
        type=str(w.type),
        num_bits=int(w.num_bits),
        strategy=str(w.strategy),
        group_size=None if w.group_size is None else int(w.group_size),
        symmetric=bool(w.symmetric),
        dynamic_activations=a is not None,
    )
    if scheme.strategy not in ("tensor", "channel", "group"):
        raise CheckpointFormatError(
            f"{where}: weight strategy {scheme.strategy!r} is not supported"
        )
    if a is not None:
        _check_activations(where, a, scheme)
    expected = {
        "pack-quantized": scheme.type == "int" and scheme.num_bits in (4, 8) and a is None,
        "int-quantized": scheme.type == "int" and scheme.num_bits == 8 and a is not None,
        "float-quantized": scheme.type == "float" and scheme.num_bits == 8,
    }[fmt]
    if not expected:
        raise CheckpointFormatError(f"{where}: {fmt} with {scheme.describe()} is not supported")
    if fmt != "pack-quantized" and (scheme.strategy == "group" or not scheme.symmetric):
        raise CheckpointFormatError(
            f"{where}: {fmt} is supported with symmetric per-channel or per-tensor scales only"
        )
    return _Group(tuple(group.targets), fmt, scheme)


def _check_activations(where: str, a: Any, scheme: WeightScheme) -> None:
    if not a.dynamic or str(a.strategy) != "token":
        raise CheckpointFormatError(
            f"{where}: only dynamic per-token activation quantization is supported "
            f"(found dynamic={a.dynamic}, strategy={a.strategy}; static input scales are not read)"
        )
    if str(a.type) != scheme.type or int(a.num_bits) != 8 or not a.symmetric:
        raise CheckpointFormatError(
            f"{where}: activations must be symmetric 8-bit of the weights' type ({scheme.type})"
        )


def _unpacked_staging(
    module: str, fmt: str, layer: LayerShape, parts: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    n, k = layer.out_features, layer.in_features
    dtype = torch.int8 if fmt == "int-quantized" else torch.float8_e4m3fn
    expect(f"{module}.weight", parts["weight"], (n, k), dtype)
    yield f"{module}.qweight", parts["weight"]
    yield f"{module}.scales", _row_scales(f"{module}.weight_scale", parts["weight_scale"], n, 1)


def _packed_staging(
    module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    scheme, n, k = layer.scheme, layer.out_features, layer.in_features
    bits = scheme.num_bits
    shape = [int(v) for v in parts["weight_shape"].reshape(-1).tolist()]
    if shape != [n, k]:
        raise CheckpointFormatError(f"{module}.weight_shape is {shape}, expected {[n, k]}")
    if (k * bits) % 32:
        raise CheckpointFormatError(
            f"{module}: in_features {k} is not a multiple of {32 // bits} ({bits}-bit values are "
            "packed 32 bits at a time)"
        )
    group = scheme.group_size_for(k)
    if k % group or group % (32 // bits):
        raise CheckpointFormatError(
            f"{module}: group size {group} does not divide in_features {k} in whole int32 words"
        )
    expect(f"{module}.weight_packed", parts["weight_packed"], (n, k * bits // 32), torch.int32)
    groups = k // group
    scales = _row_scales(f"{module}.weight_scale", parts["weight_scale"], n, groups)
    offset = 1 << (bits - 1)
    if scheme.symmetric:
        zeros = torch.full((n, groups), offset, dtype=torch.uint8, device=scales.device)
    else:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed_zp = parts["weight_zero_point"]
        expect(f"{module}.weight_zero_point", packed_zp, (-(-n * bits // 32), groups), torch.int32)
        signed = unpack_from_int32(packed_zp, bits, torch.Size((n, groups)), packed_dim=0)
        zeros = (signed.to(torch.int16) + offset).to(torch.uint8)
    yield f"{module}.qweight", parts["weight_packed"]
    yield f"{module}.scales", scales
    yield f"{module}.zeros", zeros


def _row_scales(name: str, scale: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """float32 [n, groups]; a per-tensor scale ([] or [1]) is repeated on every row."""
    if not scale.is_floating_point():
        raise CheckpointFormatError(f"{name} has dtype {scale.dtype}, expected a float dtype")
    if scale.numel() == 1 and groups == 1:
        return scale.float().reshape(1, 1).expand(n, 1).contiguous()
    if tuple(scale.shape) != (n, groups):
        raise CheckpointFormatError(f"{name} has shape {list(scale.shape)}, expected {[n, groups]}")
    return scale.float()
