"""Gemma 2 and Gemma 3 (text): the Llama forward (models/llama.py) with Gemma's differences as
parameters, not branches of it.

- RMSNorm scales by (1 + w): `load_weights` folds the 1 into every stored norm weight (float32
  math, one rounding to the model dtype), so the shared norm kernels serve unchanged.
- The embedding is scaled by sqrt(hidden_size), rounded to the model dtype (`ScaledEmbedding`).
- Four norms per layer: input (Llama's), pre-feedforward (where Llama has post-attention), and two
  on the block outputs before each residual add, the attention's (`LayerCalls.attn_out_norm`)
  and the MLP's (`DenseMLPCalls.out_norm`), all bound in `bind_layer` through `LayerCalls.of`.
- The MLP's activation is GELU with the tanh approximation (`gelu_tanh_and_mul`).
- Attention: scale query_pre_attn_scalar ** -0.5; Gemma 2's scores are soft-capped,
  tanh(s / c) * c (`LayerCalls.softcap`, in every kernel path); sliding windows on the layers
  `layer_types` marks (Gemma 2: every other one; Gemma 3: five in six).
- Gemma 3: per-head q/k norms (also 1 + w), and its sliding layers rotate by their own table
  (`rope_local_base_freq`, no scaling) while global ones use rope_theta with rope_scaling.
- Final logits soft-capped (`final_logit_softcapping`) where set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.llm.execution.models.llama import (
    DenseMLPCalls,
    LayerCalls,
    LlamaArgs,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.tensor_parallel import NO_TENSOR_PARALLEL, TensorParallel
from kernels import KernelOps
from kernels.rotary import rope_cos_sin_cache

_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class GemmaArgs(LlamaArgs):
    """`LlamaArgs` plus Gemma's settings (the defaults are no-ops)."""

    query_pre_attn_scalar: float | None = None
    """The attention scale is its inverse square root (None: head_dim's)."""
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float | None = None
    """Gemma 3: the rope base of the sliding layers (no scaling); None: every layer uses
    rope_theta / rope_scaling."""

    @classmethod
    def from_gemma_config(
        cls, cfg: Mapping[str, Any], sliding_pattern: int, local_rope_theta: float | None
    ) -> GemmaArgs:
        """From a Gemma 2 / Gemma 3 text config.json; `sliding_pattern`: transformers' default
        layer pattern (every `sliding_pattern`-th layer global) for configs without
        `layer_types`; `local_rope_theta`: the sliding layers' default rope base (None: theirs is
        the global one)."""
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GEMMA_ACTIVATIONS:
            raise ValueError(
                f"hidden_activation={act!r} is not supported (expected gelu_pytorch_tanh)"
            )
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported (decoder-only serving)")
        cfg = dict(cfg, hidden_act="silu")  # the activation is Gemma's own, not LlamaArgs'
        if cfg.get("layer_types") is None:
            pattern = cfg.get("sliding_window_pattern", sliding_pattern)
            cfg["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
        cfg.setdefault("tie_word_embeddings", True)  # Gemma's config default
        local_theta = local_rope_theta
        params = cfg.get("rope_parameters")
        if isinstance(params, Mapping) and "full_attention" in params:
            # Gemma 3 (transformers 5): one rope dict per layer type.
            cfg["rope_parameters"] = params["full_attention"]
            local = params.get("sliding_attention") or {}
            local_theta = float(local.get("rope_theta", local_theta or 10000.0))
        elif "rope_local_base_freq" in cfg:
            local_theta = float(cfg["rope_local_base_freq"])
        base = LlamaArgs.from_hf_config(cfg)
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            **{f: getattr(base, f) for f in LlamaArgs.__dataclass_fields__},
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            local_rope_theta=local_theta,
        )


class ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: rows times sqrt(hidden_size), the factor rounded to the weight's dtype
    (as transformers' scaled word embedding)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim**0.5).to(self.weight.dtype)
        return F.embedding(input_ids, self.weight) * scale


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (module docstring)."""

    supports_tensor_parallel = False  # its own shapes are not sharded yet
    supports_pipeline_parallel = False  # its hooks walk every layer

    SLIDING_PATTERN = 2
    """transformers' default for configs without layer_types: every second layer global."""
    QK_NORM = False
    LOCAL_ROPE_THETA: float | None = None
    """The sliding layers' own rope base when the config names none (None: the global one)."""

    args: GemmaArgs

    def __init__(
        self,
        args: GemmaArgs,
        ops: KernelOps,
        device: torch.device,
        max_position: int | None = None,
        tp: TensorParallel = NO_TENSOR_PARALLEL,
        pp: PipelineStage = NO_PIPELINE,
    ):
        super().__init__(args, ops, device, max_position, tp, pp)
        self.model.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size)
        for layer in self.model.layers:
            layer.pre_feedforward_layernorm = RMSNorm(args.hidden_size)
            layer.post_feedforward_layernorm = RMSNorm(args.hidden_size)
        self.tie_weights()
        self.local_rope_cache: torch.Tensor | None = None
        """float32 cos/sin table of the sliding layers (Gemma 3); None: they use `rope_cache`."""
        if args.local_rope_theta is not None:
            with torch.device(device):
                self.local_rope_cache = rope_cos_sin_cache(
                    args.head_dim,
                    max_position or args.max_position_embeddings,
                    args.local_rope_theta,
                    None,
                    torch.float32,
                    device,
                )

    @classmethod
    def args_from_config(cls, cfg: Mapping[str, Any]) -> GemmaArgs:
        args = GemmaArgs.from_gemma_config(cfg, cls.SLIDING_PATTERN, cls.LOCAL_ROPE_THETA)
        return replace(args, qk_norm=cls.QK_NORM)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`LlamaForCausalLM.load_weights`, then every norm weight w stored as 1 + w."""
        super().load_weights(weights)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(param.float() + 1.0)

    def bind_layer(self, layer: LlamaDecoderLayer, index: int) -> LayerCalls:
        """Llama's calls with Gemma's norms (pre-feedforward where Llama has post-attention, and
        both block outputs normed), GELU(tanh), attention scale, soft-cap and local rope."""
        a = self.args
        mlp = DenseMLPCalls.of(
            layer.mlp,
            index,
            activation="gelu_tanh_and_mul",
            out_norm=layer.post_feedforward_layernorm.weight,
        )
        return LayerCalls.of(
            layer,
            index,
            a,
            mlp,
            post_norm=layer.pre_feedforward_layernorm.weight,
            attn_out_norm=layer.post_attention_layernorm.weight,
            scale=(a.query_pre_attn_scalar or a.head_dim) ** -0.5,
            softcap=a.attn_softcap,
            rope=self.local_rope_cache if a.sliding_windows[index] is not None else None,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3, text only (Gemma3TextConfig): Gemma 2 plus q/k norms and local/global rope."""

    SLIDING_PATTERN = 6
    QK_NORM = True
    LOCAL_ROPE_THETA = 10000.0
