"""A vision-language checkpoint's tensors outside the decoder (vision tower, projector): renamed
from the checkpoint's layout, routed away from the decoder's `load_weights`, and copied into
transformers' modules by name, every parameter accounted for."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn


class VisionWeights:
    """The parameters of modules held beside the decoder, as "<part>:<parameter name>"."""

    def __init__(self, parts: dict[str, nn.Module]):
        self.parts = parts
        self._params = {
            f"{part}:{name}": param
            for part, module in parts.items()
            for name, param in module.named_parameters()
        }
        self._pending = set(self._params)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into the parameter `name` ("<part>:<parameter>")."""
        if name not in self._params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching vision parameter")
        param = self._params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        self._pending.discard(name)

    def finish_loading(self, dtype: torch.dtype) -> None:
        """Check that every parameter was loaded, then cast the modules to the model's dtype."""
        if self._pending:
            raise ValueError(f"vision parameters left unloaded: {sorted(self._pending)[:5]}")
        for module in self.parts.values():
            module.to(dtype).eval()


def route(
    weights: Iterable[tuple[str, torch.Tensor]],
    prefixes: Sequence[tuple[str, str]],
    vision: VisionWeights,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors under its own names; the others loaded into `vision`. `prefixes`:
    (checkpoint prefix, replacement), first match wins; a replacement "<part>:" sends the tensor
    to that part of `vision`."""
    for name, tensor in weights:
        target = next(
            (new + name[len(old) :] for old, new in prefixes if name.startswith(old)), name
        )
        if ":" in target:
            vision.load(target, tensor)
        else:
            yield target, tensor
