"""A decode step's decoder layers as one C++ call (`torch.ops.llm_cpu.decode_layers`,
kernels/csrc/decode_layers_cpu.cpp): the captured decode step of the CPU.

The Llama forward's layer loop (models/llama.py) makes about 25 Python-level calls per layer; on a
small model they cost as much as a tenth of the step. Where a model's layers are plain (the Llama
forward with no per-layer variant: no q/k norms, own rope table, soft-cap or extra norms, a dense
SiLU MLP, one rank) and every projection is a blocked-GEMV `Linear` (backend_lib/linear.py: float32
or bfloat16 weights on CPU, packed), `bind` gathers the weights once; a step of at most `max_rows`
rows with the C++ kernels serving it whole, no LoRA, images or interruption, then runs its layers
in that one call, making the same op calls in the same order as the Python loop (the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend_lib.linear import Linear


@dataclass(frozen=True)
class DecodeLayers:
    """The bound arguments of `llm_cpu::decode_layers` for one model (kernels/csrc/decode_layers_cpu.cpp)."""

    weights: list[torch.Tensor]
    """Per layer: input norm, post-attention norm, then the qkv, o, gate_up and down blocked weights
    ([NB, KP, BN, P], kernels/gemv.py)."""
    biases: list[torch.Tensor | None]
    """Per layer: the four projections' float32 biases (None: none)."""
    out_features: list[int]
    """Per layer: the four projections' output widths."""
    scales: list[float]
    """Per layer: the attention scale."""
    sliding_windows: list[int]
    """Per layer: the attention window (0: none)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    final_norm: torch.Tensor
    """[hidden_size]: the model's last norm."""
    max_rows: int
    """Most rows of x a step may have: every projection's `Linear.gemv_max_rows`."""

    @classmethod
    def bind(cls, layers: Sequence, final_norm: torch.Tensor, args) -> DecodeLayers | None:
        """The bound call of plain layers (`LayerCalls`, module docstring); None where any layer
        is not, or the projections' dtype is not the hidden states' (`final_norm`'s)."""
        if not all(_is_plain(calls) for calls in layers):
            return None
        weights, biases, out_features, max_rows = [], [], [], []
        for calls in layers:
            projections = (calls.qkv, calls.o, calls.mlp.gate_up, calls.mlp.down)
            operands = [p.gemv_operands for p in projections]
            weights += [calls.input_norm, calls.post_norm, *(w for w, _ in operands)]
            biases += [b for _, b in operands]
            out_features += [p.out_features for p in projections]
            max_rows += [p.gemv_max_rows for p in projections]
        if {w.dtype for w in weights if w.dim() == 4} != {final_norm.dtype}:
            return None
        return cls(
            weights,
            biases,
            out_features,
            [calls.scale for calls in layers],
            [calls.sliding_window or 0 for calls in layers],
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            final_norm,
            min(max_rows),
        )

    def takes(self, num_rows: int, kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> bool:
        """Whether a step of `num_rows` rows over these caches suits the call: few enough rows,
        caches without scales (not 8-bit)."""
        return num_rows <= self.max_rows and all(len(kv) == 2 for kv in kv_caches)


def _is_plain(calls) -> bool:
    """Whether a layer's `LayerCalls` are the plain Llama layer the C++ loop runs: no per-layer
    variant, one rank, a dense SiLU MLP, blocked-GEMV projections."""
    # Here, not at the top: models/llama.py imports this module.
    from backend_lib.llm.execution.models.llama import DenseMLPCalls

    mlp = calls.mlp
    variants = (calls.q_norm, calls.rope, calls.softcap, calls.attn_out_norm, calls.reduce_o)
    return (
        all(v is None for v in variants)
        and isinstance(mlp, DenseMLPCalls)
        and mlp.activation == "silu_and_mul"
        and mlp.reduce is None
        and mlp.out_norm is None
        and all(_plain_gemv(p) for p in (calls.qkv, calls.o, mlp.gate_up, mlp.down))
    )


def _plain_gemv(projection) -> bool:
    """Whether a projection is a blocked-GEMV `Linear` with no activation."""
    return (
        isinstance(projection, Linear) and projection.uses_gemv and projection.activation == "none"
    )
