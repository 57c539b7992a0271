"""The model runner's LoRA adapters on one rank: what an adapter must match (`spec`), the device
slots a step's adapters are made resident in (lora/slots.py), and on a tensor-parallel rank other
than 0 the adapters loaded from the paths rank 0 names."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.step_input import LoRAStep
from backend_lib.llm.execution.tensor_parallel import TensorParallel
from backend_lib.llm.lora.adapter import LoRAAdapter, LoRAModelSpec, LoRAModule, load_adapter
from backend_lib.llm.lora.request import LoRARequest
from backend_lib.llm.lora.slots import LoRASlots


def lora_model_spec(architecture: str, model, args) -> LoRAModelSpec:
    """What an adapter must match on `model` (a checkpoint of `architecture`) with shapes `args`
    (the whole model's, or a tensor-parallel rank's shard)."""
    return LoRAModelSpec.for_llama(
        architecture,
        args.num_layers,
        args.hidden_size,
        args.intermediate_size,
        args.num_heads * args.head_dim,
        args.num_kv_heads * args.head_dim,
        mlp=getattr(model, "LORA_COVERS_MLP", True),
    )


class RunnerLoRA:
    """Adapter slots and specs of one rank's model (slots None: LoRA disabled)."""

    def __init__(
        self,
        config: LLMConfig,
        model,
        architecture: str,
        tp: TensorParallel,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.config, self.model, self.tp = config, model, tp
        self.spec = lora_model_spec(architecture, model, model.full_args)
        """What an adapter must match to run on this model (the whole model's shapes)."""
        self.slots: LoRASlots | None = None
        if config.enable_lora:
            self.slots = LoRASlots(
                lora_model_spec(architecture, model, model.args),  # this rank's shapes
                config.max_loras,
                config.max_lora_rank,
                device,
                dtype,
                shard=self._shard if tp.size > 1 else None,
            )
        self._rank_adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        """On the other ranks: adapters loaded from the paths rank 0 names, by lora_int_id."""

    def _shard(self, layer: int, projection: str, module: LoRAModule):
        return self.tp.shard_lora(
            layer, projection, module.lora_a, module.lora_b, self.model.full_args
        )

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Load the step's adapters into slots; lora_int_id -> slot (empty: no adapter)."""
        if not requests:
            return {}
        if self.slots is None:
            raise ValueError("a sequence has a LoRA adapter but enable_lora is off")
        return self.slots.activate(requests)

    def rank_requests(self, lora: LoRAStep) -> list[LoRARequest]:
        """On a rank other than 0: the step's adapters as requests, each loaded from the path rank
        0 named (once, then kept while among the max_cpu_loras most recently used)."""
        c = self.config
        requests = []
        for lora_id, name, path in lora.adapters:
            adapter = self._rank_adapters.get(lora_id)
            if adapter is None:
                adapter = load_adapter(name, Path(path), self.spec, c.max_lora_rank)
                self._rank_adapters[lora_id] = adapter
                while len(self._rank_adapters) > max(c.max_cpu_loras, c.max_loras):
                    self._rank_adapters.popitem(last=False)
            self._rank_adapters.move_to_end(lora_id)
            requests.append(LoRARequest(name, lora_id, path, adapter))
        return requests
