"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on a paged KV cache, flattened batches.

One implementation; the architectures differ only in `LlamaArgs` flags: Qwen2 has q/k/v biases,
Qwen3 normalises q and k per head, Mistral (and Qwen2/3 when enabled) use a sliding window.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` merges the
checkpoint's separate tensors into them. With a `LoRABatch` (backend_lib/llm/lora/batch.py),
each fused projection's output gets every row's own adapter delta (one batched call per
projection for all adapters of the step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from backend_lib.llm.execution.attention import AttentionMetadata, KVCache, PagedAttention
from backend_lib.llm.execution.models.llama_native import NativeForward
from backend_lib.llm.lora.batch import LoRABatch
from kernels import KernelOps
from kernels.rotary import rope_cos_sin_cache

_SUPPORTED_ACTIVATIONS = ("silu", "swish")
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
"""Position limit of a config.json that does not state one (transformers' usual default)."""


@dataclass(frozen=True)
class LlamaArgs:
    """Shape and variant flags of one checkpoint, read from its config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attend to the last `w` positions only, or None for full attention."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        act = cfg.get("hidden_act", "silu")
        if act not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={act!r} is not supported (expected silu)")
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling = _rope_settings(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get(
                "max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(cfg, num_layers),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


def _rope_settings(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if rope_type == "default" else scaling)


def _sliding_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window following transformers: `layer_types` when given; else Qwen2/3's
    `use_sliding_window` + `max_window_layers`; else Mistral's `sliding_window` on every layer."""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first_sliding = cfg.get("max_window_layers", 0)
        layer_types = [
            "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


class RMSNorm(nn.Module):
    """RMSNorm through the kernel op; with `residual` it adds first and returns the new residual."""

    def __init__(self, dim: int, eps: float, ops: KernelOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, ops: KernelOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, ops) if args.qk_norm else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            args.sliding_windows[layer_idx],
            ops,
        )
        self.ops = ops
        self.layer_idx = layer_idx

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.apply(self.layer_idx, "qkv", qkv, hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Qwen3: RMSNorm over each head's vector, before rotary.
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.ops.apply_rotary(positions, q, k, rope_cache)
        out = self.attn(q, k, v, kv_cache, meta).reshape(num_tokens, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer_idx, "o", self.o_proj(out), out)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, ops: KernelOps, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_up_proj = nn.Linear(
            args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias
        )
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate_up = lora.apply(self.layer_idx, "gate_up", self.gate_up_proj(x), x)
        act = self.ops.silu_and_mul(gate_up)
        return lora.apply(self.layer_idx, "down", self.down_proj(act), act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, ops: KernelOps):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(args, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)
        self.mlp = LlamaMLP(args, ops, layer_idx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor,
        lora: LoRABatch | None = None,
        keep_rows: torch.Tensor | None = None,
    ):
        """`keep_rows` (int64 [R], without LoRA): after the attention block (which writes every row's
        K/V), only these rows go on, in this order."""
        # The residual stream is carried separately so each norm fuses the residual add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rope_cache, lora)
        if keep_rows is not None:
            hidden, residual = (
                hidden.index_select(0, keep_rows),
                residual.index_select(0, keep_rows),
            )
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, ops: KernelOps):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i, ops) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, ops)


# Checkpoint tensor name part -> (fused parameter name part, shard index).
_FUSED_SHARDS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama decoder over a paged KV cache. `forward` returns hidden states of all flattened
    tokens; `compute_logits` projects only the rows that are sampled."""

    def __init__(
        self, args: LlamaArgs, ops: KernelOps, device: torch.device, max_position: int | None = None
    ):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, ops)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        self.native: NativeForward | None = None
        """The CPU fast path of `forward` (llama_native.py), once `build_native_forward` finds it usable."""
        # Plain attribute, not a buffer: never in the state dict, and built for real on `device`
        # even while the loader creates the parameters under a meta-device context.
        # Float32 keeps the angles exact.
        with torch.device(device):
            self.rope_cache = rope_cos_sin_cache(
                args.head_dim,
                max_position or args.max_position_embeddings,
                args.rope_theta,
                args.rope_scaling,
                torch.float32,
                device,
            )

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        return LlamaArgs.from_hf_config(cfg)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (again after `to_empty`)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_native_forward(self) -> None:
        """Set up the CPU fast path when every piece of it is native (after weights are loaded and
        the projections packed; see llama_native.py)."""
        self.native = NativeForward.build(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        lora: LoRABatch | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]; `lora`
        maps rows to adapters (None: the base model for every row).

        `output_rows` (int64 [R], may repeat): return only these rows' states [R, hidden_size], in
        this order. The last layer's MLP then runs on them alone: a prompt token's state past its
        last layer's attention feeds nothing but its own logits, which nobody samples (its K/V, all
        a later token needs, are written before). Same values as selecting afterwards."""
        if self.native is not None and NativeForward.serves(meta, lora):
            return self.native(input_ids, positions, meta, kv_caches, output_rows)
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        last = len(self.model.layers) - 1
        # With LoRA rows the MLP's adapters follow the full row layout: select at the end instead.
        keep_rows = output_rows if lora is None else None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            hidden, residual = layer(
                positions, hidden, residual, kv_cache, meta, self.rope_cache, lora,
                keep_rows if i == last else None,
            )  # fmt: skip
        hidden, _ = self.model.norm(hidden, residual)
        if output_rows is not None and keep_rows is None:
            hidden = hidden.index_select(0, output_rows)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden_size] -> float32 logits [R, vocab_size]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, merging fused projections.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        pending = {(name, shard) for name in params for shard in _shards_of(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed, never loaded
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied to embed_tokens (some checkpoints store the copy anyway)
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            dest = self._shard_view(params[target], target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            pending.discard((target, shard))
        if pending:
            missing = sorted(_checkpoint_name(name, shard) for name, shard in pending)
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing)}")

    def _shard_view(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param.data
        a = self.args
        if ".qkv_proj." in name:
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            offset, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:
            offset, size = shard * a.intermediate_size, a.intermediate_size
        return param.data.narrow(0, offset, size)


def _shards_of(param_name: str) -> tuple[int | None, ...]:
    """Checkpoint tensors that fill a parameter: shard indices of a fused one, (None,) otherwise."""
    if ".qkv_proj." in param_name:
        return (0, 1, 2)
    return (0, 1) if ".gate_up_proj." in param_name else (None,)


def _checkpoint_name(param_name: str, shard: int | None) -> str:
    """The checkpoint tensor name that fills `shard` of parameter `param_name`."""
    for part, (fused, index) in _FUSED_SHARDS.items():
        if fused in param_name and index == shard:
            return param_name.replace(fused, part)
    return param_name


def _fused_target(name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in _FUSED_SHARDS.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases, optional `sliding_window` on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q/k/v projections only."""

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        return replace(LlamaArgs.from_hf_config(cfg), qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k; `head_dim` is explicit in the config."""

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        return replace(LlamaArgs.from_hf_config(cfg), qk_norm=True)
