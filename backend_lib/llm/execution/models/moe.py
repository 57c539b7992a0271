"""Mixtures of experts on the Llama forward: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is a `LlamaForCausalLM` whose sparse layers' MLP is a `SparseMoeBlock` (the forward's MLP
hook, `build_mlp`/`bind_mlp`): a router (`gate`), `num_experts` gated experts of which each token
runs `top_k`, and for Qwen2-MoE a shared expert every token runs, scaled by
sigmoid(`shared_expert_gate`). Routing is transformers': softmax of the router logits in float32,
the top k, renormalised over the k or not (kernels/fused_moe.py `moe_route`); Qwen's routing
weights are rounded to the model's dtype before weighting, as transformers does.

Two layouts of the experts, chosen by the model's kernel backend:
- "torch" (CPU): one `ExpertMLP` of `nn.Linear`s per expert, so the loader packs them for oneDNN
  and int8 quantization replaces them (`backend_lib/linear.py`, `backend_lib/quantization.py`);
  the forward runs each expert once over all its tokens (`grouped_moe`).
- "triton": the experts stacked as [E, 2I, H] and [E, H, I] parameters (`StackedExperts`), for
  the fused MoE Triton kernel (`fused_moe_triton`). Not quantized.

Checkpoints hold one tensor per expert (the hub layout, also what transformers 5's
`save_pretrained` writes): Mixtral `block_sparse_moe.experts.E.w1/w3/w2`, Qwen
`mlp.experts.E.gate_proj/up_proj/down_proj`; transformers 5's in-memory stacked
`mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I] load too.

LoRA on these models covers the attention projections (`LORA_COVERS_MLP` False: adapters on MLP
or expert weights are refused at adapter load).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.llm.execution.models.llama import (
    DenseMLPCalls,
    LlamaArgs,
    LlamaForCausalLM,
    LlamaMLP,
    MLPCall,
    _projection,
)
from backend_lib.llm.execution.models.step_kernels import StepKernels
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel
from backend_lib.llm.lora.batch import LoRABatch
from kernels import KernelOps, kernel_ops
from kernels.fused_moe import ExpertCalls, grouped_moe, moe_route


@dataclass(frozen=True)
class MoEArgs(LlamaArgs):
    """`LlamaArgs` plus the mixture-of-experts fields of config.json."""

    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    """Each routed expert's intermediate size (dense layers use `intermediate_size`)."""
    renormalize: bool = True
    """Divide the top-k routing weights by their sum (Mixtral always; Qwen's `norm_topk_prob`)."""
    round_weights: bool = False
    """Round the routing weights to the model's dtype before weighting (Qwen's routers)."""
    sparse_layers: tuple[bool, ...] = ()
    """Per layer: a `SparseMoeBlock` (True) or a dense MLP of `intermediate_size` (False)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (0: none)."""


def _qwen_sparse_layers(cfg: Mapping[str, Any], num_layers: int, num_experts: int) -> tuple:
    """transformers' rule: sparse unless in `mlp_only_layers`, on every `decoder_sparse_step`-th."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )


def _num_experts(cfg: Mapping[str, Any]) -> int:
    """`num_experts` (hub Qwen configs) or `num_local_experts` (Mixtral; transformers 5's Qwen3)."""
    value = cfg.get("num_experts", cfg.get("num_local_experts"))
    if value is None:
        raise KeyError("num_experts")
    return int(value)


class Weight(nn.Module):
    """A bare weight matrix under the checkpoint's `<name>.weight` (routers: kept out of the
    `nn.Linear`s the loader packs or quantizes, so routing stays in the model's dtype)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class ExpertMLP(nn.Module):
    """One gated expert (gate/up fused), bias-free."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class StackedExperts(nn.Module):
    """All experts of a layer as two stacked weights (the fused Triton kernel's layout)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoeBlock(nn.Module):
    """A sparse layer's parameters: router, experts, optional shared expert and its gate."""

    def __init__(self, args: MoEArgs, stacked: bool):
        super().__init__()
        h, e, i = args.hidden_size, args.num_experts, args.moe_intermediate_size
        self.gate = Weight(e, h)
        self.experts: nn.Module = (
            StackedExperts(e, h, i) if stacked else nn.ModuleList(ExpertMLP(h, i) for _ in range(e))
        )
        shared = args.shared_expert_intermediate_size
        self.shared_expert = ExpertMLP(h, shared) if shared else None
        self.shared_expert_gate = Weight(1, h) if shared else None


@dataclass(frozen=True, slots=True)
class DenseNoLoRACalls:
    """A dense layer of a mixture-of-experts model: LoRA there covers attention only."""

    dense: DenseMLPCalls

    def __call__(
        self, kernels: StepKernels, x: torch.Tensor, lora: LoRABatch | None
    ) -> torch.Tensor:
        return self.dense(kernels, x, None)


@dataclass(frozen=True, slots=True)
class SparseMoECalls:
    """A `SparseMoeBlock` bound to its final weights: route, run the experts, add the shared one."""

    router: torch.Tensor
    """[E, hidden_size]."""
    top_k: int
    renormalize: bool
    round_weights: bool
    experts: tuple[ExpertCalls, ...] | None
    """The grouped path's per-expert projections (None on the stacked path)."""
    stacked: tuple[torch.Tensor, torch.Tensor] | None
    """(w_gate_up [E, 2I, H], w_down [E, H, I]) for `fused` (None on the grouped path)."""
    fused: Callable[..., torch.Tensor]
    """The kernel backend's `fused_moe` (stacked path)."""
    shared: DenseMLPCalls | None
    shared_gate: torch.Tensor | None
    """[1, hidden_size]."""

    def __call__(
        self, kernels: StepKernels, x: torch.Tensor, lora: LoRABatch | None
    ) -> torch.Tensor:
        weights, ids = moe_route(F.linear(x, self.router), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        if self.stacked is not None:
            out = self.fused(x, *self.stacked, weights, ids)
        else:
            out = grouped_moe(x, weights, ids, self.experts, kernels.silu_and_mul)
        if self.shared is not None:
            shared = self.shared(kernels, x, None)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out


_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
"""A stacked experts tensor: our `StackedExperts` parameter, and transformers 5's in memory."""
_GROUPED_PARAM = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
_SHARED_SHARDS = {
    ".mlp.shared_expert.gate_proj.": (".mlp.shared_expert.gate_up_proj.", 0),
    ".mlp.shared_expert.up_proj.": (".mlp.shared_expert.gate_up_proj.", 1),
}


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama forward with `SparseMoeBlock`s on the sparse layers (module docstring)."""

    supports_tensor_parallel = False  # its own shapes are not sharded yet

    LORA_COVERS_MLP = False
    """Adapters may target the attention projections only (model_runner builds the spec)."""
    _HUB_BLOCK = "mlp"
    """The checkpoint's name of a sparse layer's block (Mixtral: block_sparse_moe)."""
    _HUB_EXPERT = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    """Our expert projection names -> the checkpoint's (Mixtral: w1, w3, w2)."""

    args: MoEArgs

    def __init__(
        self,
        args: MoEArgs,
        ops: KernelOps,
        device: torch.device,
        max_position: int | None = None,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        pp: PipelineStage = NO_PIPELINE,
    ):
        # Read by build_mlp, which LlamaForCausalLM.__init__ calls.
        self._stacked = ops is kernel_ops("triton")
        super().__init__(args, ops, device, max_position, tp, pp)

    def build_mlp(self, args: MoEArgs, index: int) -> nn.Module:  # type: ignore[override]
        if args.sparse_layers[index]:
            return SparseMoeBlock(args, self._stacked)
        return LlamaMLP(args)

    def bind_mlp(self, mlp: nn.Module, index: int) -> MLPCall:  # type: ignore[override]
        if not isinstance(mlp, SparseMoeBlock):
            return DenseNoLoRACalls(DenseMLPCalls.of(mlp, index))
        a = self.args
        stacked = experts = None
        if isinstance(mlp.experts, StackedExperts):
            stacked = (mlp.experts.gate_up_proj.data, mlp.experts.down_proj.data)
        else:
            experts = tuple(
                (_projection(e.gate_up_proj), _projection(e.down_proj)) for e in mlp.experts
            )
        shared = None
        if mlp.shared_expert is not None:
            shared = DenseMLPCalls.of(mlp.shared_expert, index)
        return SparseMoECalls(
            router=mlp.gate.weight,
            top_k=a.top_k,
            renormalize=a.renormalize,
            round_weights=a.round_weights,
            experts=experts,
            stacked=stacked,
            fused=self.ops.fused_moe,
            shared=shared,
            shared_gate=None if mlp.shared_expert_gate is None else mlp.shared_expert_gate.weight,
        )

    # --- checkpoint names -----------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_split_stacked(weights))

    def _from_hub(self, name: str) -> str:
        """A checkpoint name in our naming (Mixtral's block and expert names mapped)."""
        if self._HUB_BLOCK == "mlp":
            return name
        name = name.replace(f".{self._HUB_BLOCK}.", ".mlp.")
        for ours, hub in self._HUB_EXPERT.items():
            name = re.sub(rf"(\.experts\.\d+)\.{hub}\.", rf"\1.{ours}.", name)
        return name

    def fused_target(self, name: str) -> tuple[str, int | None]:  # type: ignore[override]
        name = self._from_hub(name)
        match = _EXPERT_TENSOR.match(name)
        if match is not None:
            prefix, expert, proj = match[1], int(match[2]), match[3]
            if self._stacked:
                if proj == "down_proj":
                    return f"{prefix}.down_proj", expert
                return f"{prefix}.gate_up_proj", 2 * expert + (proj == "up_proj")
            if proj == "down_proj":
                return f"{prefix}.{expert}.down_proj.weight", None
            return f"{prefix}.{expert}.gate_up_proj.weight", int(proj == "up_proj")
        for part, (fused, shard) in _SHARED_SHARDS.items():
            if part in name:
                return name.replace(part, fused), shard
        return LlamaForCausalLM.fused_target(name)

    def shards_of(self, param_name: str) -> tuple[int | None, ...]:  # type: ignore[override]
        match = _STACKED.match(param_name)
        if match is not None:
            per_expert = 2 if match[2] == "gate_up_proj" else 1
            return tuple(range(per_expert * self.args.num_experts))
        return LlamaForCausalLM.shards_of(param_name)

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:  # type: ignore[override]
        stacked, grouped = _STACKED.match(param_name), _GROUPED_PARAM.match(param_name)
        if stacked is not None or grouped is not None:
            if stacked is not None:
                prefix, proj = stacked[1], stacked[2]
                expert, part = divmod(shard, 2) if proj == "gate_up_proj" else (shard, 0)
            else:
                prefix, expert, proj, part = grouped[1], int(grouped[2]), grouped[3], shard or 0
            ours = ("gate_proj", "up_proj")[part] if proj == "gate_up_proj" else "down_proj"
            name = f"{prefix}.{expert}.{self._HUB_EXPERT[ours]}.weight"
            return name.replace(".mlp.", f".{self._HUB_BLOCK}.")
        for part, (fused, index) in _SHARED_SHARDS.items():
            if fused in param_name and index == shard:
                return param_name.replace(fused, part)
        if self.args.sparse_layers and ".mlp.gate." in param_name:
            return param_name.replace(".mlp.", f".{self._HUB_BLOCK}.")
        return LlamaForCausalLM.checkpoint_name(param_name, shard)

    def shard_view(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        if shard is not None:
            match = _STACKED.match(name)
            if match is not None:
                if match[2] == "down_proj":
                    return param.data[shard]
                expert, part = divmod(shard, 2)
                half = param.shape[1] // 2
                return param.data[expert].narrow(0, part * half, half)
            if ".gate_up_proj." in name:  # experts, shared expert, dense layers: halves
                half = param.shape[0] // 2
                return param.data.narrow(0, shard * half, half)
        return super().shard_view(param, name, shard)


def _split_stacked(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's stacked expert tensors as per-expert ones (views); the rest unchanged."""
    for name, tensor in weights:
        match = _STACKED.match(name)
        if match is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix = match[1]
        for expert, t in enumerate(tensor.unbind(0)):
            if match[2] == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", t
            else:
                gate, up = t.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: every layer sparse, top-k renormalised, float32 routing weights; no biases;
    `sliding_window` (when set) on every layer."""

    _HUB_BLOCK = "block_sparse_moe"
    _HUB_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> MoEArgs:
        base = LlamaArgs.from_hf_config(cfg)
        return MoEArgs(
            **_fields(base),
            num_experts=_num_experts(cfg),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=base.intermediate_size,
            renormalize=True,
            round_weights=False,
            sparse_layers=(True,) * base.num_layers,
        )


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: q/k/v biases, a shared expert with a sigmoid gate, `norm_topk_prob`,
    `decoder_sparse_step` / `mlp_only_layers`."""

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> MoEArgs:
        base = replace(
            LlamaArgs.from_hf_config(cfg), qkv_bias=bool(cfg.get("qkv_bias", True)), o_bias=False
        )
        return _qwen_args(base, cfg, int(cfg.get("shared_expert_intermediate_size", 0)))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: per-head q/k norms, no shared expert, `norm_topk_prob`, `decoder_sparse_step` /
    `mlp_only_layers`."""

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> MoEArgs:
        return _qwen_args(replace(LlamaArgs.from_hf_config(cfg), qk_norm=True), cfg, 0)


def _qwen_args(base: LlamaArgs, cfg: Mapping[str, Any], shared: int) -> MoEArgs:
    num_experts = _num_experts(cfg)
    return MoEArgs(
        **_fields(base),
        num_experts=num_experts,
        top_k=int(cfg.get("num_experts_per_tok", 1)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        round_weights=True,
        sparse_layers=_qwen_sparse_layers(cfg, base.num_layers, num_experts),
        shared_expert_intermediate_size=shared,
    )


def _fields(args: LlamaArgs) -> dict[str, Any]:
    return {f: getattr(args, f) for f in LlamaArgs.__dataclass_fields__}


__all__ = [
    "MixtralForCausalLM",
    "MoEArgs",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
]
