"""The scheduler's LoRA rule: running sequences use at most `max_loras` distinct adapters (the
base model is free), so every step fits the device's adapter slots."""

from __future__ import annotations

from collections.abc import Iterable

from backend_lib.llm.core.sequence import Sequence


class AdapterBudget:
    """Which sequences may join the running ones without one adapter too many."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        """Distinct adapters allowed among running sequences (0: LoRA disabled)."""

    @staticmethod
    def in_use(running: Iterable[Sequence]) -> set[int]:
        """The adapter ids of `running` (the base model, id 0, left out)."""
        return {seq.lora_int_id for seq in running} - {0}

    def fits(self, seq: Sequence, loras: set[int]) -> bool:
        """Whether `seq` may run beside the adapters `loras` (added to it when so)."""
        lora_id = seq.lora_int_id
        if lora_id == 0 or lora_id in loras:
            return True
        if len(loras) >= self.max_loras:
            return False
        loras.add(lora_id)
        return True
