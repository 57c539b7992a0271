"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on a paged KV cache, flattened batches.

One implementation; the architectures differ only in `LlamaArgs` flags: Qwen2 has q/k/v biases,
Qwen3 normalises q and k per head, Mistral (and Qwen2/3 when enabled) use a sliding window.
Gemma 2/3 (models/gemma.py) and Phi-3 (models/phi3.py) subclass it with their differences as
`LayerCalls` fields (per-layer rope table, attention soft-cap, attention output norm) and hooks.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` merges the
checkpoint's separate tensors into them. With a `LoRABatch` (backend_lib/llm/lora/batch.py),
each fused projection's output gets every row's own adapter delta (one batched call per
projection for all adapters of the step).

The modules only hold the parameters under the checkpoint's names. The forward is written once,
in `LlamaForCausalLM`: a loop over `LayerCalls` (each layer's norm weights and projection calls,
bound once the weights are final) that calls its kernels through one binding per step
(models/step_kernels.py: straight C++ op calls, or the `KernelOps` wrappers), no module call per
op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from backend_lib.linear import PackedLinear
from backend_lib.llm.execution.attention import AttentionMetadata, KVCache
from backend_lib.llm.execution.mm_embeds import MultiModalEmbeds
from backend_lib.llm.execution.models.decode_layers import DecodeLayers
from backend_lib.llm.execution.models.step_kernels import (
    CppKernels,
    CppOps,
    OpsKernels,
    StepKernels,
)
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.step_interrupt import Interrupt, StepInterrupted
from backend_lib.llm.execution.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel
from backend_lib.llm.lora.batch import LoRABatch
from kernels import KernelOps, cpu_extension, kernel_ops
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
    rotary_dim: int | None = None
    """Leading dims of each head that rotary embedding turns (Phi-3's partial_rotary_factor);
    None: all of head_dim."""

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
    """An RMSNorm's weight (the forward applies it with `LlamaArgs.rms_norm_eps`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim) if args.qk_norm else None


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(
            args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias
        )
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)


MLPFactory = Callable[["LlamaArgs", int], nn.Module]
"""(args, layer index) -> that layer's MLP parameters module (dense `LlamaMLP` by default)."""


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size)
        self.mlp = mlp


class OtherStageLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, keeps the layer indices."""


class LlamaModel(nn.Module):
    """The parameters under the checkpoint's names; `LlamaForCausalLM.forward` computes with them."""

    def __init__(
        self,
        args: LlamaArgs,
        mlp_factory: MLPFactory,
        vocab_rows: int | None = None,
        pp: PipelineStage = NO_PIPELINE,
    ):
        """`vocab_rows`: the embedding rows this rank holds (tensor parallelism; default all).
        `pp`: this rank's pipeline stage, which holds its own layers, the embedding on stage 0
        and the final norm on the last stage (the others are None or `OtherStageLayer`s)."""
        super().__init__()
        held = pp.layers(args.num_layers)
        self.embed_tokens = (
            nn.Embedding(vocab_rows or args.vocab_size, args.hidden_size) if pp.first else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, mlp_factory(args, i)) if i in held else OtherStageLayer()
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size) if pp.last else None


Projection = Callable[[torch.Tensor], torch.Tensor]
MLPCall = Callable[[StepKernels, torch.Tensor, "LoRABatch | None"], torch.Tensor]
"""A layer's MLP block as the forward calls it: (kernels, normed x [N, hidden_size], lora) ->
[N, hidden_size]. Dense layers bind `DenseMLPCalls`; other blocks (mixtures of experts) their own."""


@dataclass(frozen=True, slots=True)
class DenseMLPCalls:
    """A gated dense MLP (gate/up fused, activation, down, optional output norm) bound to its
    final weights."""

    index: int
    gate_up: Projection
    """[N, hidden_size] -> [N, 2 * intermediate_size]."""
    down: Projection
    """[N, intermediate_size] -> [N, hidden_size]."""
    reduce: Projection | None = None
    """Row-parallel down_proj (tensor parallelism): the sum of the ranks' partial outputs, taken
    after their LoRA deltas (each rank's from its own input columns); None on one rank."""
    activation: str = "silu_and_mul"
    """The `StepKernels` gated activation: SiLU; Gemma's GELU(tanh) "gelu_tanh_and_mul"."""
    out_norm: torch.Tensor | None = None
    """[hidden_size]: a norm of the block's output before the residual add (Gemma's
    post_feedforward_layernorm); None for the others."""

    @classmethod
    def of(
        cls,
        mlp: LlamaMLP,
        index: int,
        activation: str = "silu_and_mul",
        out_norm: torch.Tensor | None = None,
    ) -> DenseMLPCalls:
        return cls(
            index,
            _projection(mlp.gate_up_proj),
            _projection(mlp.down_proj),
            activation=activation,
            out_norm=out_norm,
        )

    def __call__(
        self, kernels: StepKernels, x: torch.Tensor, lora: LoRABatch | None
    ) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if lora is not None:
            lora.apply(self.index, "gate_up", gate_up, x)
        activated = getattr(kernels, self.activation)(gate_up)
        out = self.down(activated)
        if lora is not None:
            lora.apply(self.index, "down", out, activated)
        if self.reduce is not None:
            out = self.reduce(out)
        return out if self.out_norm is None else kernels.rms_norm(out, self.out_norm, None)[0]


@dataclass(frozen=True, slots=True)
class LayerCalls:
    """One decoder layer as the forward calls it, bound to its final weights (`bind_forward`)."""

    index: int
    input_norm: torch.Tensor
    """[hidden_size] in the model's dtype, like every norm weight."""
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    """[head_dim]: Qwen3's per-head norms of q and k (None for the others)."""
    k_norm: torch.Tensor | None
    qkv: Projection
    """[T, hidden_size] -> [T, (num_heads + 2 * num_kv_heads) * head_dim]."""
    o: Projection
    """[T, num_heads * head_dim] -> [T, hidden_size]."""
    mlp: MLPCall
    scale: float
    sliding_window: int | None
    """Attend to the last `w` positions only; None: full attention."""
    rope: torch.Tensor | None = None
    """float32 [max_position, rotary_dim]: this layer's own cos/sin table (Gemma 3's local
    layers); None: the model's `rope_cache`."""
    softcap: float | None = None
    """Attention logit soft-capping, scores -> tanh(scores / c) * c (Gemma 2); None: none."""
    attn_out_norm: torch.Tensor | None = None
    """[hidden_size]: Gemma's norm of the attention output before the residual add; None for
    the others."""
    reduce_o: Projection | None = None
    """Row-parallel o_proj (tensor parallelism): the sum of the ranks' partial outputs, after
    their LoRA deltas; None on one rank."""

    @classmethod
    def of(
        cls, layer: LlamaDecoderLayer, index: int, args: LlamaArgs, mlp: MLPCall, **variant: Any
    ) -> LayerCalls:
        """Layer `index`'s calls; `variant`: a family's own field values over Llama's (Gemma's
        norms, attention scale, soft-cap and rope table)."""
        attn = layer.self_attn
        fields = {
            "input_norm": layer.input_layernorm.weight,
            "post_norm": layer.post_attention_layernorm.weight,
            "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
            "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
            "qkv": _projection(attn.qkv_proj),
            "o": _projection(attn.o_proj),
            "scale": args.head_dim**-0.5,
            "sliding_window": args.sliding_windows[index],
        }
        return cls(index=index, mlp=mlp, **(fields | variant))


def _projection(module: nn.Module) -> Projection:
    """What calling `module` (nn.Linear, PackedLinear, QuantizedLinear or WNA16Linear) on a 2-D
    input ends in, without nn.Module's call machinery (~2 us a call)."""
    if isinstance(module, PackedLinear):
        return module.inner
    call_2d = getattr(module, "call_2d", None)
    return module.forward if call_2d is None else call_2d()


# Checkpoint tensor name part -> (fused parameter name part, shard index).
_FUSED_SHARDS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Llama decoder over a paged KV cache. `forward` returns hidden states of the flattened
    tokens; `compute_logits` projects only the rows that are sampled."""

    supports_tensor_parallel = True
    """Whether `tensor_parallel.TensorParallel` can shard this class (subclasses with other
    shapes say False until their sharding is written)."""
    supports_pipeline_parallel = True
    """Whether this class runs as a stage of `pipeline_parallel.PipelineStage` (subclasses whose
    hooks assume every layer is held say False)."""

    def __init__(
        self,
        args: LlamaArgs,
        ops: KernelOps,
        device: torch.device,
        max_position: int | None = None,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        pp: PipelineStage = NO_PIPELINE,
    ):
        """`tp`: this rank's share of a tensor-parallel group; `args` then become this rank's
        shapes (`args`: its heads and MLP width; `full_args`: the whole model's). `pp`: this
        rank's pipeline stage (its layers `held_layers`; the lm_head on stage 0 only)."""
        super().__init__()
        self.tp, self.pp, self.full_args = tp, pp, args
        args = self.args = tp.local_args(args)
        self.ops = ops
        self.held_layers = pp.layers(args.num_layers)
        _, vocab_rows = tp.vocab_rows(args.vocab_size)
        self.model = LlamaModel(args, self.build_mlp, vocab_rows, pp)
        self.lm_head = nn.Linear(args.hidden_size, vocab_rows, bias=False) if pp.first else None
        self.tie_weights()
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self._qkv_sizes = (q_size, kv_size, kv_size)
        self.layer_calls: tuple[LayerCalls, ...] | None = None
        """Every decoder layer's calls, set by `bind_forward`."""
        self.cpp_ops: CppOps | None = None
        """Set by `bind_forward` where the C++ library takes this model (the "torch" kernels, CPU
        weights of a dtype it computes in): the steps it serves whole then run as straight calls
        (`CppKernels`). None: the `KernelOps` wrappers serve every step."""
        self.decode_layers: DecodeLayers | None = None
        """Set by `bind_forward` where `cpp_ops` is and every layer is plain with blocked-GEMV
        projections (models/decode_layers.py): small steps run all layers in one C++ call."""
        # Plain attribute, not a buffer: never in the state dict, and built for real on `device`
        # even while the loader creates the parameters under a meta-device context.
        # Float32 keeps the angles exact.
        with torch.device(device):
            self.rope_cache = rope_cos_sin_cache(
                args.rotary_dim or args.head_dim,
                max_position or args.max_position_embeddings,
                args.rope_theta,
                args.rope_scaling,
                torch.float32,
                device,
            )

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> LlamaArgs:
        return LlamaArgs.from_hf_config(cfg)

    @staticmethod
    def build_mlp(args: LlamaArgs, index: int) -> nn.Module:
        """Layer `index`'s MLP parameters (subclasses with other MLP blocks override this and
        `bind_mlp`)."""
        return LlamaMLP(args)

    @staticmethod
    def bind_mlp(mlp: nn.Module, index: int) -> MLPCall:
        """The forward's call of layer `index`'s MLP, bound to its final weights."""
        return DenseMLPCalls.of(mlp, index)

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (again after `to_empty`)."""
        if self.args.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_layer(self, layer: LlamaDecoderLayer, index: int) -> LayerCalls:
        """Layer `index`'s calls bound to its final weights (subclasses whose layers differ
        override this, passing their differences to `LayerCalls.of`)."""
        return LayerCalls.of(layer, index, self.args, self.bind_mlp(layer.mlp, index))

    def bind_forward(self) -> tuple[LayerCalls, ...]:
        """Bind the forward's calls to the final weights: after `load_weights` and any packing or
        quantization of the projections (the loader calls it; a first forward without it does).
        Returns `layer_calls`."""
        layers = self.model.layers
        self.layer_calls = tuple(
            self._row_parallel(self.bind_layer(layers[i], i)) for i in self.held_layers
        )
        first_norm = self.layer_calls[0].input_norm
        native = self.ops == kernel_ops("torch") and cpu_extension.takes(first_norm)
        self.cpp_ops = CppOps.load() if native else None
        self.decode_layers = None
        if native and self.pp.first and self.pp.last:
            self.decode_layers = DecodeLayers.bind(
                self.layer_calls, self.model.norm.weight, self.args
            )
        return self.layer_calls

    def _row_parallel(self, calls: LayerCalls) -> LayerCalls:
        """`calls` with o_proj and a dense MLP's down_proj summed over the tensor-parallel ranks."""
        if self.tp.size == 1:
            return calls
        mlp = calls.mlp
        if isinstance(mlp, DenseMLPCalls):
            mlp = replace(mlp, reduce=self.tp.all_reduce)
        return replace(calls, reduce_o=self.tp.all_reduce, mlp=mlp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        lora: LoRABatch | None = None,
        output_rows: torch.Tensor | None = None,
        mm_embeds: MultiModalEmbeds | None = None,
        interrupt: Interrupt | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden_size]; `lora`
        maps rows to adapters (None: the base model for every row); `mm_embeds`: rows whose
        input embedding is an image's encoder output instead of their token's (placeholders).
        `interrupt`: asked before each layer; True raises StepInterrupted (step_interrupt.py).

        `output_rows` (int64 [R], may repeat): return only these rows' states [R, hidden_size], in
        this order. The last layer's MLP then runs on them alone: a prompt token's state past its
        last layer's attention feeds nothing but its own logits, which nobody samples (its K/V, all
        a later token needs, are written before). Same values as selecting afterwards.

        Under pipeline parallelism (`pp`) each stage runs its own layers (`kv_caches`: theirs)
        between the activations it receives and sends; stage 0 returns the last stage's output
        rows, the other stages an empty [0, hidden_size]."""
        layers = self.layer_calls if self.layer_calls is not None else self.bind_forward()
        kernels = self.step_kernels(positions, meta)
        one_call = self.decode_layers
        if (
            one_call is not None
            and isinstance(kernels, CppKernels)
            and lora is None
            and mm_embeds is None
            and interrupt is None
            and one_call.takes(len(input_ids), kv_caches)
        ):
            hidden = self.embed(input_ids)
            return kernels.decode_layers(one_call, hidden, kv_caches, output_rows)
        pp, width = self.pp, self.args.hidden_size
        # The residual stream is carried separately so each norm fuses the residual add.
        if pp.first:
            hidden, residual = self.embed(input_ids), None
            if mm_embeds is not None:
                hidden.index_copy_(0, mm_embeds.rows, mm_embeds.values.to(hidden.dtype))
        else:
            hidden, residual = pp.recv_forward(len(input_ids), width, *self._activations())
        # With LoRA rows the MLP's adapters follow the full row layout: select at the end instead.
        keep_rows = output_rows if lora is None else None
        last = layers[-1] if pp.last else None
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            if interrupt is not None and interrupt():
                raise StepInterrupted
            normed, residual = kernels.rms_norm(hidden, layer.input_norm, residual)
            hidden = self._attention(kernels, layer, normed, kv_cache, lora)
            if keep_rows is not None and layer is last:
                hidden = hidden.index_select(0, keep_rows)
                residual = residual.index_select(0, keep_rows)
            normed, residual = kernels.rms_norm(hidden, layer.post_norm, residual)
            hidden = layer.mlp(kernels, normed, lora)
        if not pp.last:
            pp.send_forward(hidden, residual)
            if not pp.first:
                return hidden.new_empty((0, width))
            rows = len(input_ids) if output_rows is None else len(output_rows)
            return pp.recv_output(rows, width, *self._activations())
        hidden, _ = kernels.rms_norm(hidden, self.model.norm.weight, residual)
        if output_rows is not None and keep_rows is None:
            hidden = hidden.index_select(0, output_rows)
        if not pp.first:
            pp.send_output(hidden)
        return hidden

    def _activations(self) -> tuple[torch.dtype, torch.device]:
        """The dtype and device of the hidden states (those of the norm weights)."""
        norm = self.layer_calls[0].input_norm
        return norm.dtype, norm.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden_size] (vocabulary-parallel under tensor parallelism)."""
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        return self.tp.embed(self.model.embed_tokens.weight, input_ids, self.args.vocab_size)

    def step_kernels(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_cache: torch.Tensor | None = None,
    ) -> StepKernels:
        """The kernel binding of a step (models/step_kernels.py): straight C++ op calls where
        `cpp_ops` is set and they serve the step whole, else the `KernelOps` wrappers. Rotary
        reads row `positions[t]` of `rope_cache` (default: the model's table)."""
        eps, rope = self.args.rms_norm_eps, self.rope_cache if rope_cache is None else rope_cache
        if self.cpp_ops is not None and CppKernels.serves(meta):
            return CppKernels(self.cpp_ops, positions, meta, rope, eps)
        return OpsKernels(self.ops, positions, meta, rope, eps)

    def _attention(
        self,
        kernels: StepKernels,
        layer: LayerCalls,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        """`layer`'s attention block on normed hidden [T, hidden_size] -> o_proj's output
        [T, hidden_size] (normed by `attn_out_norm` where set); writes every row's K/V into
        `kv_cache`."""
        a = self.args
        qkv = layer.qkv(hidden)
        if lora is not None:
            lora.apply(layer.index, "qkv", qkv, hidden)
        tokens = qkv.shape[0]
        q, k, v = qkv.split(self._qkv_sizes, dim=-1)
        q = q.reshape(tokens, a.num_heads, a.head_dim)
        k = k.reshape(tokens, a.num_kv_heads, a.head_dim)
        v = v.reshape(tokens, a.num_kv_heads, a.head_dim)
        if layer.q_norm is not None:
            # Qwen3: RMSNorm over each head's vector, before rotary.
            q = kernels.rms_norm(q.reshape(-1, a.head_dim), layer.q_norm, None)[0].view_as(q)
            k = kernels.rms_norm(k.reshape(-1, a.head_dim), layer.k_norm, None)[0].view_as(k)
        q, k = kernels.rotary(q, k, layer.rope)
        attended = kernels.attend(
            q, k, v, kv_cache, layer.scale, layer.sliding_window, layer.softcap
        )
        attended = attended.reshape(tokens, self._qkv_sizes[0])
        out = layer.o(attended)
        if lora is not None:
            lora.apply(layer.index, "o", out, attended)
        if layer.reduce_o is not None:
            out = layer.reduce_o(out)
        if layer.attn_out_norm is not None:
            out = kernels.rms_norm(out, layer.attn_out_norm, None)[0]
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden_size] -> float32 logits [R, vocab_size] (each rank's vocabulary rows
        gathered under tensor parallelism)."""
        return self.tp.gather_columns(self.lm_head(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, merging fused projections.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        pending = {(name, shard) for name in params for shard in self.shards_of(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed, never loaded
            if name == "lm_head.weight" and self.args.tie_word_embeddings:
                continue  # tied to embed_tokens (some checkpoints store the copy anyway)
            if not self.pp.holds(name, self.args.num_layers):
                continue  # another pipeline stage's
            tensor = self.tp.shard(name, tensor, self.full_args)
            target, shard = self.fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            dest = self.shard_view(params[target], target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            pending.discard((target, shard))
        if pending:
            missing = sorted(self.checkpoint_name(name, shard) for name, shard in pending)
            raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing)}")

    # Name mapping between checkpoint tensors and fused parameters; subclasses whose checkpoints
    # name or fuse tensors otherwise override these four.

    @staticmethod
    def fused_target(name: str) -> tuple[str, int | None]:
        """Checkpoint tensor `name` -> (parameter name, shard index or None when unfused)."""
        return _fused_target(name)

    @staticmethod
    def shards_of(param_name: str) -> tuple[int | None, ...]:
        """The shard indices that fill parameter `param_name`: (None,) when unfused."""
        return _shards_of(param_name)

    @staticmethod
    def checkpoint_name(param_name: str, shard: int | None) -> str:
        """The checkpoint tensor name that fills `shard` of `param_name` (for error messages)."""
        return _checkpoint_name(param_name, shard)

    def shard_view(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The rows of parameter `name` that checkpoint shard `shard` fills (all of it for None)."""
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
