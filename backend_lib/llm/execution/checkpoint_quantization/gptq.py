"""GPTQ checkpoints (`quant_method: gptq`: GPTQModel, AutoGPTQ, optimum / transformers).

Per quantized module, with K inputs, N outputs, G = K / group_size groups (1 per channel,
`group_size: -1`) and b bits (4 or 8; p = 32 / b values per word):

- `qweight` int32 [K / p, N], packed along K: input k of column n is bits [(k % p) * b, +b) of
  word k // p, unsigned u in [0, 2^b). The engine's `wna16` layout packs rows the same way, so
  the staging qweight is its transpose.
- `qzeros` int32 [G, ceil(N / p)], packed along N the same way.
  `checkpoint_format` (or `format`) "gptq" (v1, the default and what vLLM and transformers read):
  the zero points were stored minus one, by subtracting 0x11111111 (4 bits) or 0x01010101
  (8 bits) from each whole word (GPTQModel's `convert_gptq_v2_to_v1_format_module`), so an
  asymmetric zero point of 0 borrowed from the next value of its word; the exact inverse, adding
  the constant back to the word modulo 2^32 (its `convert_gptq_v1_to_v2_format_module`), is what
  is done here. "gptq_v2": stored as they are. Symmetric checkpoints store 2^(b-1) (v2), 2^(b-1)-1
  (v1).
- `scales` float16 [G, N]; `g_idx` int32 [K], the group of each input. w = (u - z) * s.
- `desc_act` (act-order) checkpoints quantize inputs in another order, so `g_idx` interleaves
  the groups. As exllama and vLLM do, the inputs are sorted by group (`perm = argsort(g_idx)`,
  stable): the staged weight's column j is input perm[j], its groups contiguous again, and the
  layer computes on x[:, perm] (layers.py's input permutation). q/k/v and gate/up share their
  input, so fusing them needs one order: a checkpoint whose fused layers' g_idx differ is
  refused. Every layer stages its order; the identity is dropped at finalize.

Config keys read: `bits`, `group_size`, `desc_act`, `sym`, `checkpoint_format` / `format`,
`pack_dtype`, `lm_head`, GPTQModel's `dynamic` per-module overrides (first match in order, a
Python `re.match` of the module name; `-:` leaves a match in full precision, `+:` or no prefix
overrides bits, group_size, desc_act, sym) and optimum's `modules_in_block_to_quantize`. The rest
(calibration settings, `meta`, kernel choices) do not change what is stored. Refused, named: other
bits, packing dtypes, formats (marlin, bitblas, ...), override keys.
"""

from __future__ import annotations

import re
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

METHOD = "gptq"
BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_OVERRIDABLE = ("bits", "group_size", "desc_act", "sym", "pack_dtype")
_REQUIRED = frozenset({"qweight", "qzeros", "scales", "g_idx"})


def _v1_offset(bits: int) -> int:
    """What v1 subtracted from each qzeros word: one in every value's lowest bit."""
    return sum(1 << (bits * j) for j in range(32 // bits))


class GPTQFormat(PackedIntFormat):
    """A parsed GPTQ `quantization_config`: each layer's scheme, and the conversion of its stored
    tensors into `wna16` staging tensors plus its input order."""

    method = METHOD

    def __init__(self, quantization_config: Mapping[str, Any]):
        config = dict(quantization_config)
        self.checkpoint_format = _checkpoint_format(config)
        self.base = _settings("quantization_config", config, base=None)
        self.lm_head = bool(config.get("lm_head", False))
        dynamic = config.get("dynamic") or {}
        if not isinstance(dynamic, Mapping):
            raise CheckpointFormatError("GPTQ quantization_config.dynamic must be an object")
        self.dynamic: tuple[tuple[re.Pattern, frozenset | None], ...] = tuple(
            _dynamic_rule(pattern, overrides, self.base) for pattern, overrides in dynamic.items()
        )
        blocks = config.get("modules_in_block_to_quantize")
        self.in_block = None if not blocks else tuple(_flatten(blocks))

    def describe(self) -> str:
        """E.g. "gptq W4A16 group 128 symmetric desc_act, checkpoint_format gptq"."""
        settings = {self.base, *(s for _, s in self.dynamic if s is not None)}
        parts = sorted(
            int_scheme(s["bits"], s["group_size"], s["sym"]).describe()
            + (" desc_act" if s["desc_act"] else "")
            for s in map(dict, settings)
        )
        return f"{METHOD} {', '.join(parts)}, checkpoint_format {self.checkpoint_format}"

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme checkpoint module `module` is stored in; None where it stays in full
        precision (a negative `dynamic` rule, not in `modules_in_block_to_quantize`, lm_head
        without `lm_head: true`)."""
        if module.split(".")[-1] == "lm_head" and not self.lm_head:
            return None
        listed = self.in_block is not None and ".layers." in module
        if listed and not any(module.endswith(f".{name}") for name in self.in_block):
            return None
        settings = self._settings(module)
        if settings is None:
            return None
        s = dict(settings)
        return int_scheme(s["bits"], s["group_size"], s["sym"])

    def _settings(self, module: str) -> frozenset | None:
        for pattern, settings in self.dynamic:
            if pattern.match(module):
                return settings
        return self.base

    def required(self, module: str, layer: LayerShape) -> frozenset[str]:
        return _REQUIRED

    def staging(
        self, module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scheme, n, k = layer.scheme, layer.out_features, layer.in_features
        bits = scheme.num_bits
        per_word = 32 // bits
        if k % per_word:
            raise CheckpointFormatError(
                f"{module}: in_features {k} is not a multiple of {per_word} ({bits}-bit values are "
                "packed 32 bits at a time)"
            )
        group = scheme.group_size_for(k)
        check_divides(module, k, group, bits)
        groups = k // group
        qweight, qzeros, g_idx = parts["qweight"], parts["qzeros"], parts["g_idx"]
        expect(f"{module}.qweight", qweight, (k // per_word, n), torch.int32)
        expect(f"{module}.qzeros", qzeros, (groups, -(-n // per_word)), torch.int32)
        scales = expect_scales(f"{module}.scales", parts["scales"], groups, n)
        perm = _input_order(f"{module}.g_idx", g_idx, k, group)

        if bool((perm == torch.arange(k, device=perm.device)).all()):
            staged = qweight.T.contiguous()  # the same packing along K, transposed
        else:
            u = unpack_last_dim(qweight.T.contiguous(), bits, k)  # [N, K] in stored order
            staged = wna16.pack_wna16(u[:, perm], bits)
        words = qzeros.to(torch.int64) & 0xFFFFFFFF
        if self.checkpoint_format == "gptq":
            words = (words + _v1_offset(bits)) & 0xFFFFFFFF
        zeros = unpack_last_dim(words, bits, n).T.to(torch.uint8).contiguous()
        yield f"{module}.qweight", staged
        yield f"{module}.scales", scales
        yield f"{module}.zeros", zeros
        yield f"{module}.perm", perm


def _input_order(name: str, g_idx: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """The inputs sorted by group (int64 [K]); CheckpointFormatError unless that puts exactly
    `group` inputs in each group, in group order."""
    if tuple(g_idx.shape) != (k,) or g_idx.is_floating_point() or g_idx.is_complex():
        raise CheckpointFormatError(
            f"{name} is {g_idx.dtype} {list(g_idx.shape)}, expected an integer dtype {[k]}"
        )
    g = g_idx.to(torch.int64)
    perm = torch.argsort(g, stable=True)
    expected = torch.arange(k, device=g.device) // group
    if not torch.equal(g[perm], expected):
        raise CheckpointFormatError(
            f"{name} does not put {group} inputs in each of the {k // group} groups "
            "(groups of other sizes, or static groups that are not contiguous, are not supported)"
        )
    return perm


def _checkpoint_format(config: dict) -> str:
    if config.get("is_marlin_format"):
        raise CheckpointFormatError("GPTQ is_marlin_format checkpoints are not supported")
    fmt = config.get("format") or config.get("checkpoint_format") or "gptq"
    fmt = str(fmt).lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise CheckpointFormatError(
            f"GPTQ checkpoint format {fmt!r} is not supported; supported: "
            + ", ".join(CHECKPOINT_FORMATS)
        )
    return fmt


def _settings(where: str, values: Mapping[str, Any], base: frozenset | None) -> frozenset:
    """bits, group_size, desc_act, sym (as a hashable frozenset of items), `values` over `base`
    (the config's defaults: transformers' GPTQConfig ones where a key is absent)."""
    merged = dict(base) if base is not None else {}
    defaults = {"bits": None, "group_size": 128, "desc_act": False, "sym": True}
    for key, default in defaults.items():
        if key in values:
            merged[key] = values[key]
        elif base is None:
            merged[key] = default
    pack_dtype = str(values.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise CheckpointFormatError(
            f"{where}: GPTQ pack_dtype {pack_dtype!r} is not supported; supported: int32"
        )
    bits, group = merged["bits"], merged["group_size"]
    if bits not in BITS:
        raise CheckpointFormatError(
            f"{where}: GPTQ bits {bits!r} is not supported; supported: " + ", ".join(map(str, BITS))
        )
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise CheckpointFormatError(f"{where}: GPTQ group_size {group!r} is not supported")
    merged["desc_act"], merged["sym"] = bool(merged["desc_act"]), bool(merged["sym"])
    return frozenset(merged.items())


def _dynamic_rule(
    pattern: str, overrides: Any, base: frozenset
) -> tuple[re.Pattern, frozenset | None]:
    where = f"quantization_config.dynamic[{pattern!r}]"
    negative = pattern.startswith("-:")
    raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
    try:
        compiled = re.compile(raw)
    except re.error as e:
        raise CheckpointFormatError(f"{where}: not a regular expression: {e}") from e
    if negative:
        return compiled, None
    if not isinstance(overrides, Mapping):
        raise CheckpointFormatError(f"{where} must be an object of overrides")
    unsupported = sorted(set(overrides) - set(_OVERRIDABLE))
    if unsupported:
        raise CheckpointFormatError(
            f"{where} overrides {', '.join(unsupported)}, which is not supported; supported: "
            + ", ".join(_OVERRIDABLE)
        )
    return compiled, _settings(where, overrides, base)


def _flatten(blocks: Any) -> Iterator[str]:
    for item in blocks:
        if isinstance(item, str):
            yield item
        else:
            yield from _flatten(item)
