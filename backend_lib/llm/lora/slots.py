"""LoRASlots: `max_loras` adapters resident on the device at once, as stacked weights the batched
LoRA kernel indexes by slot; adapters are loaded into free slots, else replace the least recently
used resident adapter that the step does not need.

The model fuses q/k/v and gate/up into one matmul each, so the slots are laid out per fused
projection (`FUSED_TARGETS`): for q/k/v, lora_a stacks the three A matrices along the rank
([3R, hidden]: one shrink) and lora_b is block-diagonal ([q + 2 kv, 3R]: one expand). Ranks below
R (`max_lora_rank`) and projections an adapter leaves alone are zero-padded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from backend_lib.llm.lora.adapter import LoRAAdapter, LoRAModelSpec, LoRAModule
from backend_lib.llm.lora.request import LoRARequest

FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The model's fused projections and the adapter projections each one concatenates (in order)."""
WHOLE_MODULES = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
"""Fused projections an adapter may also adapt whole (Phi-3's checkpoint names): its A fills the
first rank rows of the slot's lora_a, its B the first rank columns of lora_b, all rows."""

ModuleShard = Callable[[int, str, LoRAModule], tuple[torch.Tensor, torch.Tensor]]
"""(layer, projection, module) -> this rank's (lora_a, lora_b) of it (tensor parallelism)."""


class LoRASlots:
    """Device weights of the resident adapters and which adapter sits in which slot."""

    def __init__(
        self,
        spec: LoRAModelSpec,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        shard: ModuleShard | None = None,
    ) -> None:
        """`spec`: this rank's projection shapes; `shard`: how an adapter module (validated
        against the whole model's shapes) is cut to them (None: one rank, whole)."""
        self.spec, self.max_loras, self.max_rank = spec, max_loras, max_rank
        self._shard = shard
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        """Per layer, per fused target: (lora_a [max_loras, n*R, in], lora_b [max_loras, out, n*R])
        with n the target's projection count and the adapter's scaling folded into lora_b."""
        for _ in range(spec.num_layers):
            layer = {}
            for target, parts in FUSED_TARGETS.items():
                if parts[0] not in spec.shapes:  # not adaptable on this model (MoE MLPs)
                    continue
                in_features = spec.shapes[parts[0]][0]
                out_features = sum(spec.shapes[p][1] for p in parts)
                ranks = len(parts) * max_rank
                layer[target] = (
                    torch.zeros(max_loras, ranks, in_features, device=device, dtype=dtype),
                    torch.zeros(max_loras, out_features, ranks, device=device, dtype=dtype),
                )
            self.weights.append(layer)
        self._resident: OrderedDict[int, int] = OrderedDict()
        """lora_int_id -> slot, least recently used first."""
        self.num_loads = 0
        self.load_seconds = 0.0
        """Total time spent copying adapters into slots."""

    @property
    def resident_ids(self) -> list[int]:
        """Adapter ids in slots, least recently used first."""
        return list(self._resident)

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Make the step's adapters resident; returns lora_int_id -> slot. More distinct adapters
        than slots is a scheduler bug (ValueError)."""
        needed = {r.lora_int_id: r for r in requests}
        if len(needed) > self.max_loras:
            raise ValueError(f"{len(needed)} adapters in one step, only {self.max_loras} slots")
        for lora_id in needed:
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
        for lora_id, request in needed.items():
            if lora_id not in self._resident:
                self._resident[lora_id] = self._take_slot(needed)
                self._load(self._resident[lora_id], request.adapter)
        return {lora_id: self._resident[lora_id] for lora_id in needed}

    def _take_slot(self, needed: dict[int, LoRARequest]) -> int:
        used = set(self._resident.values())
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if free:
            return free[0]
        victim = next(lora_id for lora_id in self._resident if lora_id not in needed)
        return self._resident.pop(victim)

    @torch.no_grad()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        started = time.perf_counter()
        rank = self.max_rank
        for layer, targets in enumerate(self.weights):
            for target, (lora_a, lora_b) in targets.items():
                lora_a[slot].zero_()
                lora_b[slot].zero_()
                row = 0
                for index, part in enumerate(FUSED_TARGETS[target]):
                    out_features = self.spec.shapes[part][1]
                    module = adapter.modules.get((layer, part))
                    if module is not None:
                        a, b = module.lora_a, module.lora_b
                        if self._shard is not None:
                            a, b = self._shard(layer, part, module)
                        cols = slice(index * rank, index * rank + module.rank)
                        lora_a[slot, cols] = a  # copy_ casts and moves
                        lora_b[slot, row : row + out_features, cols] = b
                    row += out_features
                whole = adapter.modules.get((layer, WHOLE_MODULES.get(target, "")))
                if whole is not None:
                    lora_a[slot, : whole.rank] = whole.lora_a
                    lora_b[slot, :, : whole.rank] = whole.lora_b
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - started
