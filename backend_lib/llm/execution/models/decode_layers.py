"""A decode step's decoder layers as one C++ call (`torch.ops.llm_cpu.decode_layers`,
kernels/csrc/decode_layers_cpu.cpp): the captured decode step of the CPU.

The Llama forward's layer loop (models/llama.py) makes about 25 Python-level calls per layer; on a
small model they cost as much as a tenth of the step, and ~6 ms of a 4-bit 1B model's 37 ms. Where
a model's layers are plain (the Llama forward with no per-layer variant: no q/k norms, own rope
table, soft-cap or extra norms, a dense SiLU MLP, one rank) and every projection is one the C++
library runs, a blocked-GEMV `Linear` (backend_lib/linear.py: float32 or bfloat16 weights on CPU,
packed) or a C++-kernel `WNA16Linear` (4- or 8-bit weights, `WNA16Call`), `bind` gathers the
weights once; a step of at most `max_rows` rows with the C++ kernels serving it whole, no LoRA,
images or interruption, then runs its layers in that one call, making the same op calls in the
same order as the Python loop (the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend_lib.linear import Linear
from backend_lib.llm.execution.checkpoint_quantization.layers import WNA16Call

WNA16_MAX_ROWS = 16
"""Most rows a step with WNA16 projections runs in the one call. The op serves any rows (past a
few it dequantizes into a GEMM itself), but past a decode batch's size the Python loop's calls
cost nothing beside the arithmetic; float32's blocked GEMV stops at the same 16 rows."""


@dataclass(frozen=True)
class DecodeLayers:
    """The bound arguments of `llm_cpu::decode_layers` for one model (kernels/csrc/decode_layers_cpu.cpp)."""

    weights: list[torch.Tensor]
    """Per layer: input norm, post-attention norm, then the qkv, o, gate_up and down projections'
    tensors: a blocked weight ([NB, KP, BN, P], kernels/gemv.py) or a WNA16 layer's prepared
    packed words, scales and zeros (kernels/wna16_linear.py)."""
    biases: list[torch.Tensor | None]
    """Per layer: the four projections' biases (None: none)."""
    projections: list[int]
    """Per projection, 5 ints: output width, bits (0: blocked GEMV), group size, the rows from
    which a WNA16 op runs its GEMM, and whether it takes int8 activations (0 or 1)."""
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
    """Most rows of x a step may have: every blocked projection's `Linear.gemv_max_rows`, and
    WNA16_MAX_ROWS."""

    @classmethod
    def bind(cls, layers: Sequence, final_norm: torch.Tensor, args) -> DecodeLayers | None:
        """The bound call of plain layers (`LayerCalls`, module docstring); None where any layer
        is not, or a blocked projection's dtype is not the hidden states' (`final_norm`'s)."""
        if not all(_is_plain(calls) for calls in layers):
            return None
        weights, biases, projections, max_rows = [], [], [], []
        for calls in layers:
            weights += [calls.input_norm, calls.post_norm]
            for projection in (calls.qkv, calls.o, calls.mlp.gate_up, calls.mlp.down):
                operands = _operands(projection, final_norm.dtype)
                if operands is None:
                    return None
                tensors, bias, ints, rows = operands
                weights += tensors
                biases.append(bias)
                projections += ints
                max_rows.append(rows)
        return cls(
            weights,
            biases,
            projections,
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
    variant, one rank, a dense SiLU MLP."""
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
    )


def _operands(projection, dtype: torch.dtype):
    """(tensors, bias, the 5 ints of `DecodeLayers.projections`, most rows) of a projection the
    C++ loop runs on `dtype` activations: a blocked-GEMV `Linear` with no activation of that dtype,
    or a `WNA16Call`; None for any other."""
    if isinstance(projection, WNA16Call):
        if dtype not in projection.gemm_min_rows:
            return None
        tensors, ints = projection.operands(dtype)
        return tensors, projection.bias, ints, WNA16_MAX_ROWS
    if not (
        isinstance(projection, Linear)
        and projection.uses_gemv
        and projection.activation == "none"
        and projection.gemv_operands[0].dtype == dtype
    ):
        return None
    blocked, bias = projection.gemv_operands
    return [blocked], bias, [projection.out_features, 0, 0, 0, 0], projection.gemv_max_rows
