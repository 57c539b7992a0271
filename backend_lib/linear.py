"""Inference-only linear layers, shared by the encoders and the LLM.

On CPU the weight is pre-packed once into oneDNN's blocked layout, and the activation
(or the residual add) runs in the GEMM epilogue. On the AMD EPYC (AVX-512) development
machine that is 10-15% faster than `F.linear` (MKL) for the encoders' large GEMMs and
1.3-2.5x faster for the LLM's small-batch decode GEMMs (8-64 rows), and saves a pass over
the output. On CPUs without AVX-512, oneDNN's GELU epilogue is the exception: its erf
polynomial made the encoders' up-projection 20% slower than the plain packed GEMM followed by
torch's in-place GELU (1024 x 384 -> 1536 rows: 21.4 vs 17.7 ms, AMD EPYC, AVX2), so there the
GELU runs after the GEMM. Everywhere else (CUDA, float16, a torch build without oneDNN) it is
`F.linear` followed by the activation or add.

Small M (a decode step's rows, up to `GEMV_MAX_ROWS`): there oneDNN's GEMM streams the weight
below what a plain read of it achieves (~14 us fixed per call; on Intel Sapphire Rapids,
Llama-3.2-1B's projections at M = 1, 1 / 2 threads: 0.91 / 0.90 of a plain read in float32,
0.86-0.88 / 0.81-0.85 in bfloat16), so those calls go to the C++ blocked GEMV (kernels/gemv.py):
0.99 / 1.02 and 0.88-0.93 / 0.92-0.94 there. It reads the
packed bytes themselves through a view, as oneDNN packs these weights in a layout a GEMV streams
well (blocks of output rows, k-major); the view exists only where every packed byte was checked
against that layout at load (`gemv.onednn_blocked_view`) and the C++ library is built, otherwise
oneDNN serves every M. One copy of each weight either way; the GEMM path (prefill) is untouched.
bench/gemv_bandwidth.py measures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import gemv

# Activation name -> (eager function, oneDNN post-op attr, oneDNN algorithm).
_ACTIVATIONS = {
    "none": (None, "none", ""),
    "gelu": (F.gelu, "gelu", "none"),  # exact erf GELU
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu", "tanh"),
    "relu": (F.relu, "relu", ""),
    "tanh": (torch.tanh, "tanh", ""),
}

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)

GEMV_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 1}
"""Per weight dtype, up to how many rows the blocked GEMV runs instead of oneDNN's GEMM (the default
of `Linear.gemv_max_rows`). Measured crossovers (Sapphire Rapids, one thread, GB/s of weight
bytes, GEMV vs oneDNN; 2 threads alike): float32 wins at every M tried (M = 8: 14.1 vs 12.4; 16:
11.5 vs 10.1; 32: 7.8 vs 7.3), past 16 it is compute-bound and prefill-sized calls are oneDNN's;
bfloat16 only at M = 1 (17.2 vs 16.0; M = 2: 15.4 vs 15.9, M = 4: 14.2 vs 17.5): vdpbf16ps issues
once every two cycles there, and oneDNN's AMX kernel overtakes it."""

# Activations applied in place after the packed GEMM where oneDNN's epilogue is slower.
_INPLACE_GELU = {
    "gelu": lambda y: torch.ops.aten.gelu_(y),
    "gelu_tanh": lambda y: torch.ops.aten.gelu_(y, approximate="tanh"),
}


def _gelu_epilogue_pays() -> bool:
    """Whether oneDNN's GELU post-op beats GEMM-then-GELU on this CPU (see the module docstring)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """`activation(x @ weight.T + bias)` for 2-D `x`; weight is [out, in] as in checkpoints."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "none"):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}")
        self.out_features, self.in_features = weight.shape
        self.activation, self.bias = activation, bias
        self._eager_act, self._post_op, self._algorithm = _ACTIVATIONS[activation]
        self._packed = self._pack(weight) if _onednn_usable(weight) else None
        # With the packed GEMM, an activation oneDNN runs slowly here comes after it instead.
        self._after_gemm = None
        if self._packed is not None and activation in _INPLACE_GELU and not _gelu_epilogue_pays():
            self._after_gemm = _INPLACE_GELU[activation]
            self._post_op, self._algorithm = _ACTIVATIONS["none"][1:]
        # Keep the plain weight only when it is the one used (no second copy in memory).
        self.weight = weight.contiguous() if self._packed is None else None
        # The small-M path: the packed bytes viewed in the GEMV's layout (no copy), where they are.
        self._blocked = (
            None if self._packed is None else gemv.onednn_blocked_view(self._packed, weight)
        )
        self._gemv_bias = None if bias is None else bias.float().contiguous()
        self.gemv_max_rows = GEMV_MAX_ROWS.get(weight.dtype, 0)
        """Up to how many rows the GEMV serves (0: never)."""

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor | None:
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        except RuntimeError:  # e.g. a CPU without bf16 support in oneDNN
            return None

    @property
    def uses_onednn(self) -> bool:
        return self._packed is not None

    @property
    def uses_gemv(self) -> bool:
        """Whether calls of up to `gemv_max_rows` rows go to the blocked GEMV."""
        return self._blocked is not None and self.gemv_max_rows > 0

    @property
    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(blocked weight, float32 bias or None): what calls of up to `gemv_max_rows` rows pass
        the GEMV (where `uses_gemv`)."""
        return self._blocked, self._gemv_bias

    def _gemv(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = torch.ops.llm_cpu.blocked_gemv(x, self._blocked, self.out_features, self._gemv_bias)
        if residual is not None:
            return y.add_(residual)
        return y if self._eager_act is None else self._eager_act(y)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`activation(x @ W.T + b)`, plus `residual` when given (then activation must be none)."""
        if residual is not None and self._eager_act is not None:
            raise ValueError("a residual is added only to a linear without activation")
        if (
            self._blocked is not None
            and x.shape[0] <= self.gemv_max_rows
            and x.dtype == self._blocked.dtype
            and x.stride(-1) == 1
        ):
            return self._gemv(x, residual)
        if self._packed is not None:
            if residual is not None:  # the add runs in the GEMM epilogue
                return torch.ops.mkldnn._linear_pointwise.binary(
                    x, residual, self._packed, self.bias, "add"
                )
            y = torch.ops.mkldnn._linear_pointwise(
                x, self._packed, self.bias, self._post_op, [], self._algorithm
            )
            return y if self._after_gemm is None else self._after_gemm(y)
        y = F.linear(x, self.weight, self.bias)
        if residual is not None:
            return y.add_(residual)
        return y if self._eager_act is None else self._eager_act(y)


class PackedLinear(nn.Module):
    """Drop-in inference replacement of an `nn.Linear` (no activation) backed by `Linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        bias = None if linear.bias is None else linear.bias.detach()
        self.inner = Linear(linear.weight.detach(), bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the models' flattened batches: no reshapes around the call
            return self.inner(x)
        leading = x.shape[:-1]
        return self.inner(x.reshape(-1, self.in_features)).view(*leading, self.out_features)


def pack_linear_layers(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` whose weight oneDNN can pack (CPU, float32 or
    bfloat16) by a `PackedLinear`; returns how many were replaced. For inference only: the packed
    weights are no longer parameters (no state dict entries, no gradients)."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and _onednn_usable(child.weight):
                packed = PackedLinear(child)
                if packed.inner.uses_onednn:
                    setattr(parent, name, packed)
                    replaced += 1
    return replaced
