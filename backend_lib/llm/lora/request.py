"""LoRARequest: the adapter a request runs under (vLLM's name and fields)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for an annotation only: a request is plain data
    from backend_lib.llm.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRARequest:
    """A named adapter, loaded and validated (see `LoRARegistry.request`)."""

    lora_name: str
    lora_int_id: int
    """>= 1, unique per name in one engine (0 is the base model)."""
    lora_path: str
    adapter: LoRAAdapter = field(compare=False, repr=False)
    """Its weights in host memory: kept alive by every request using it."""

    @property
    def cache_salt(self) -> bytes:
        """Seeds the prefix-cache hash chain of its sequences: K/V computed under one adapter
        never match a lookup under another (or under the base model, whose chain starts empty)."""
        return hashlib.sha256(f"lora\0{self.lora_name}\0{self.lora_path}".encode()).digest()
