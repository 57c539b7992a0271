"""The Llama forward on CPU as straight calls of the C++ ops (kernels/csrc/), for steps that need
nothing else.

`LlamaForCausalLM.forward` goes through a module, a kernel-op wrapper and its checks for every op:
~75 us of Python per layer, ~0.6 ms per engine step on the benchmark's 8-layer model (measured on a
model too small for the compute to matter), which does not shrink with more threads. This path
makes the same calls in the same order on the same tensors (bit-identical output, tested), with
everything that is fixed per model read once at load and the per-step metadata converted once per
forward. It serves a step when the model is on the "torch" kernels with the C++ library loaded,
there is no per-head q/k norm (Qwen3), no LoRA row in the batch, and the attention plan leaves every
sequence to the C++ op (no SDPA chunk); otherwise the module path runs. The projections are called
as the module path calls them (oneDNN-packed, int8 or plain), a `PackedLinear` through its inner
`Linear`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend_lib.linear import PackedLinear
from backend_lib.llm.execution.attention import AttentionMetadata, KVCache
from kernels import cpu_extension, kernel_ops


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's fixed arguments."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]
    """Each projection: [T, in] -> [T, out]."""
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    scale: float
    sliding_window: int
    """0: none (the C++ op's convention)."""


class NativeForward:
    """`LlamaForCausalLM.forward` without the modules (see the module docstring)."""

    def __init__(self, model) -> None:
        self.model = model
        self.eps = model.args.rms_norm_eps
        # Head counts and sizes: the same in every layer.
        self.attention = model.model.layers[0].self_attn
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                qkv=_direct(layer.self_attn.qkv_proj),
                o=_direct(layer.self_attn.o_proj),
                gate_up=_direct(layer.mlp.gate_up_proj),
                down=_direct(layer.mlp.down_proj),
                scale=layer.self_attn.attn.scale,
                sliding_window=layer.self_attn.attn.sliding_window or 0,
            )
            for layer in model.model.layers
        ]

    @classmethod
    def build(cls, model) -> NativeForward | None:
        """The fast path of `model` (a LlamaForCausalLM with its weights loaded, packed or
        quantized), or None when a piece of it is not native (the module path then serves every
        step)."""
        if model.args.qk_norm or not cpu_extension.takes(model.model.norm.weight):
            return None
        if model.model.layers[0].self_attn.ops != kernel_ops("torch"):
            return None
        return cls(model)

    @staticmethod
    def serves(meta: AttentionMetadata, lora) -> bool:
        """Whether this step can take the fast path (module docstring)."""
        plan = meta.plan
        return (
            lora is None
            and plan is not None  # the "torch" kernels' plan (TorchAttentionPlan)
            and plan.native_seqs is not None
            and not plan.decode_groups
            and not plan.prefills
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`LlamaForCausalLM.forward`'s contract (without LoRA), `output_rows` selected where the
        module path selects them (after the last layer's attention block)."""
        ops = torch.ops.llm_cpu
        positions = positions.long().contiguous()
        slots = meta.slot_mapping.long().contiguous()
        starts = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        seqs = meta.plan.native_seqs
        rope = self.model.rope_cache
        a = self.attention
        hidden = self.model.model.embed_tokens(input_ids)
        residual = None
        last = self.layers[-1]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            normed = torch.empty_like(hidden)
            if residual is None:
                residual = hidden
                ops.rms_norm(hidden, layer.input_norm, self.eps, None, normed, normed)
            else:
                summed = torch.empty_like(hidden)
                ops.rms_norm(hidden, layer.input_norm, self.eps, residual, normed, summed)
                residual = summed
            qkv = layer.qkv(normed)
            tokens = qkv.shape[0]
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = q.view(tokens, a.num_heads, a.head_dim)
            k = k.view(tokens, a.num_kv_heads, a.head_dim)
            v = v.view(tokens, a.num_kv_heads, a.head_dim)
            q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
            k_rot = torch.empty_like(k, memory_format=torch.contiguous_format)
            ops.rotary(positions, q, k, rope, q_rot, k_rot)
            ops.write_kv_cache(k_rot, v, k_cache, v_cache, slots)
            attended = torch.empty_like(q_rot)
            ops.paged_attention(
                q_rot, k_cache, v_cache, starts, seq_lens, tables, layer.scale,
                layer.sliding_window, seqs, attended,
            )  # fmt: skip
            projected = layer.o(attended.view(tokens, a.q_size))
            if layer is last and output_rows is not None:
                projected = projected.index_select(0, output_rows)
                residual = residual.index_select(0, output_rows)
                tokens = output_rows.shape[0]
            normed, summed = torch.empty_like(projected), torch.empty_like(projected)
            ops.rms_norm(projected, layer.post_norm, self.eps, residual, normed, summed)
            residual = summed
            gate_up = layer.gate_up(normed)
            activated = gate_up.new_empty((tokens, gate_up.shape[1] // 2))
            ops.silu_and_mul(gate_up, activated)
            hidden = layer.down(activated)
        out, summed = torch.empty_like(hidden), torch.empty_like(hidden)
        ops.rms_norm(hidden, self.model.model.norm.weight, self.eps, residual, out, summed)
        return out


def _direct(projection: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the module path's call of `projection` on a 2-D input ends in."""
    return projection.inner if isinstance(projection, PackedLinear) else projection
