"""One step's LoRA mapping as the model's layers see it: which adapter slot each flattened row
uses (as `LoRASegments`) and the slots' stacked weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.llm.lora.slots import LoRASlots
from kernels import KernelOps, LoRASegments


@dataclass
class LoRABatch:
    """Passed to every layer's forward; `apply` adds each row's adapter delta to a projection."""

    slots: LoRASlots
    segments: LoRASegments
    ops: KernelOps

    def apply(self, layer: int, target: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`out` [T, N] (the fused projection `target`'s output for input `x` [T, K]) plus each
        row's LoRA delta, in place; returns `out`."""
        lora_a, lora_b = self.slots.weights[layer][target]
        self.ops.add_lora(out, x, lora_a, lora_b, self.segments)
        return out
