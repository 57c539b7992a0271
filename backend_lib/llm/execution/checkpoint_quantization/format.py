"""What every checkpoint quantization format shares: it stores each quantized module as tensors
named `<module>.<part>`; the checkpoint's tensor stream is regrouped per module, and each
complete module is converted into the engine's staging tensors (scheme.py), checked against the
layer's expected shape. A format subclass says which parts it stores (`QUANT_SUFFIXES`), which
a module needs (`required`) and how they convert (`staging`), plus `method`, `describe` and
`scheme_for`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    LayerShape,
    WeightScheme,
)


class QuantizedFormat:
    """A parsed checkpoint quantization format (see the module docstring)."""

    method: str
    QUANT_SUFFIXES: tuple[str, ...]
    """Every tensor suffix a quantized module of this format may store besides `bias`."""

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def scheme_for(self, module: str) -> WeightScheme | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def required(self, module: str, layer: LayerShape) -> frozenset[str]:  # pragma: no cover
        raise NotImplementedError

    def staging(
        self, module: str, layer: LayerShape, parts: dict[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def stored_layers(self, tensor_names: Iterable[str]) -> frozenset[str]:
        """The checkpoint modules stored quantized: those with a quantization tensor. A module
        the config matches may still be stored in full precision (a compressed-tensors `Linear`
        target does not reach transformers' fused expert tensors, for one), so the files decide."""
        layers = (name.rpartition(".") for name in tensor_names)
        return frozenset(module for module, _, suffix in layers if suffix in self.QUANT_SUFFIXES)

    def translate(
        self, tensors: Iterable[tuple[str, torch.Tensor]], layers: Mapping[str, LayerShape]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) stream with each quantized layer of `layers`
        (checkpoint module name -> its expected shape) converted into staging tensors
        (`<module>.qweight`, `.scales`, `.zeros`, and for GPTQ's act-order `.perm`: layers.py);
        every other tensor passes through unchanged."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            module, _, suffix = name.rpartition(".")
            layer = layers.get(module)
            if layer is None or suffix == "bias":
                if suffix in self.QUANT_SUFFIXES:
                    raise CheckpointFormatError(
                        f"checkpoint tensor {name!r} is quantized, but the engine has no quantized "
                        f"layer for it ({self.method}'s config leaves {module!r} unquantized, or "
                        "it is a quantized embedding or mixture-of-experts weight, which are not "
                        "supported)"
                    )
                yield name, tensor
                continue
            required = self.required(module, layer)
            if suffix not in required:
                raise CheckpointFormatError(
                    f"quantized layer {module!r} ({self.method}) has an unexpected tensor {name!r} "
                    f"(expected {', '.join(f'{module}.{r}' for r in sorted(required))})"
                )
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if required <= parts.keys():
                yield from self.staging(module, layer, pending.pop(module))
        for module in sorted(pending):
            missing = sorted(self.required(module, layers[module]) - pending[module].keys())
            raise CheckpointFormatError(
                f"quantized layer {module!r} ({self.method}) is missing "
                + ", ".join(f"{module}.{m}" for m in missing)
            )


def expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """CheckpointFormatError naming `name` unless `tensor` is `dtype` of `shape`."""
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise CheckpointFormatError(
            f"{name} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}"
        )
