"""Quantized linear layers for the LLM (`quantization: int8` or `fp8` in config.pbtxt).

Weights are quantized once at load, from the float checkpoint, per output channel and
symmetrically: row `i` of a weight [N, K] gets `scale[i] = max|w[i]| / QMAX` and
`q[i] = w[i] / scale[i]` (int8: rounded to nearest, clamped to [-127, 127], zero point 0;
fp8: cast to float8_e4m3fn, QMAX = 448). The float weights are dropped once each layer is
quantized; biases stay float.

How a quantized layer computes (`QuantizedLinear.backend`):

- `fbgemm` (CPU, int8): **W8A8-dynamic**, not weight-only. PyTorch's fbgemm dynamic linear
  (`torch.ops.quantized.linear_dynamic`) quantizes each call's activations to uint8 on the fly
  (7-bit range so AVX2's `vpmaddubsw` cannot saturate), multiplies int8 x uint8 into int32 and
  rescales to float32. fbgemm picks one scale per call; each row is first divided by its own
  max |x| (and the result multiplied back), so the activation scale is in effect per token.
  It is the fastest CPU path measured (1.2-2x faster than the float32 oneDNN linear on AVX2; see
  README "Quantization"), and passes the perplexity gate (tests/llm/execution/test_quantization_quality.py).
  The weights it holds are the same per-channel symmetric int8 values (packed by fbgemm).
- `triton` (CUDA, int8 or fp8): weight-only; `kernels.quantized_linear.quantized_linear_triton`
  dequantizes in the kernel and accumulates in float32.
- `torch` (anywhere else, e.g. a PyTorch build without fbgemm): weight-only; the dequantized
  matmul `kernels.quantized_linear.quantized_linear_torch`, also the reference of the others.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from backend_lib.config import ConfigError
from kernels.quantized_linear import quantized_linear_torch, quantized_linear_triton

QUANTIZATION_MODES = ("none", "int8", "fp8")
QUANTIZATION_SETTINGS = ("auto", *QUANTIZATION_MODES)
"""Values of a `quantization` setting (LLMConfig's, a draft model's in speculative_config)."""
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def resolve_quantization(mode: str, prequantized: str | None) -> str:
    """The at-load mode (one of QUANTIZATION_MODES) for config `quantization` `mode` (auto, or an
    at-load mode). `prequantized` describes the checkpoint's own quantization (None: full
    precision): such a checkpoint loads as stored, so only auto is accepted for it."""
    if prequantized is not None and mode != "auto":
        raise ConfigError(
            "quantization",
            mode,
            f"the checkpoint is pre-quantized ({prequantized}) and loads as stored; set auto",
        )
    return "none" if mode == "auto" else mode


def check_quantization(mode: str, device: torch.device) -> None:
    """ConfigError naming `quantization` for an unknown at-load mode, or fp8 where it cannot run."""
    if mode not in QUANTIZATION_MODES:
        raise ConfigError("quantization", mode, f"expected one of {', '.join(QUANTIZATION_MODES)}")
    if mode == "fp8" and device.type != "cuda":
        raise ConfigError("quantization", mode, "fp8 runs only on CUDA (on CPU use int8 or none)")
    if mode == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            "quantization", mode, "fp8 weights need a GPU of compute capability 8.9 or newer"
        )


def quantize_weight(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N] float32) of a float weight [N, K], per output row, symmetric
    (see the module docstring). An all-zero row gets scale 1 (and zeros)."""
    if mode not in ("int8", "fp8"):
        raise ValueError(f"unsupported quantization {mode!r}")
    w = weight.detach().float()
    qmax = INT8_MAX if mode == "int8" else FP8_MAX
    scale = w.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = w / scale[:, None]
    if mode == "int8":
        q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight a quantized one stands for: `q * scale[:, None]`."""
    return q.float() * scale.float()[:, None]


def _fbgemm_available() -> bool:
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_prepack")
        and hasattr(torch.ops.quantized, "linear_dynamic")
    )


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed int8 weight (no bias: it is added after the row scales), or None where
    that fails."""
    zero_points = torch.zeros(q.shape[0], dtype=torch.long)
    try:
        with warnings.catch_warnings():
            # The quantized-tensor API is deprecated in favour of torchao; the packed weight is
            # all this layer keeps of it, and the `torch` backend takes over when it goes away.
            warnings.simplefilter("ignore")
            qtensor = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
            return torch.ops.quantized.linear_prepack(qtensor, None)
    except (RuntimeError, AttributeError):
        return None


def _fbgemm_per_token(
    x: torch.Tensor, packed: torch.ScriptObject, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) through fbgemm's dynamic int8 linear, with per-token activation
    scales: each row is divided by its max |x| first, so the one per-call scale fbgemm picks
    (over values now within [-1, 1]) is, in effect, each row's own; the int32 GEMM's float result
    is multiplied back by the row maxima. fbgemm's reduce_range (7-bit activations) stays on:
    without it AVX2's 16-bit pair sums saturate (measured: validation perplexity +0.2% with
    per-token scales, +185% with one scale per call). A single row (a decode step's) is passed as
    it is: the per-call scale is then its own already, and the four extra ops cost more than
    its GEMM."""
    x32 = x.float()
    if x32.shape[0] == 1:
        y = torch.ops.quantized.linear_dynamic(x32.contiguous(), packed, True)
    else:
        row_max = x32.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        y = torch.ops.quantized.linear_dynamic((x32 / row_max).contiguous(), packed, True)
        y.mul_(row_max)
    if bias is not None:
        y.add_(bias)
    return y.to(x.dtype)


class QuantizedLinear(nn.Module):
    """Drop-in inference replacement of an `nn.Linear` with quantized weights (see the module
    docstring for the backends). Outputs are in the input's dtype."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        mode: str,
        backend: str | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.mode = mode
        on_cuda = qweight.device.type == "cuda"
        if backend is None:
            if on_cuda:
                backend = "triton"
            elif mode == "int8" and _fbgemm_available():
                backend = "fbgemm"
            else:
                backend = "torch"
        self._packed = None
        if backend == "fbgemm":
            self._packed = _fbgemm_pack(qweight, scale)
            if self._packed is None:
                backend = "torch"
        self.backend = backend
        # Plain attributes, not parameters or buffers: never in a state dict, never cast by
        # `.to(dtype)`. The fbgemm backend keeps only its packed copy.
        self.qweight = None if self._packed is not None else qweight.contiguous()
        self.scale = scale.float().contiguous()
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, mode: str, backend: str | None = None
    ) -> QuantizedLinear:
        q, scale = quantize_weight(linear.weight, mode)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias, mode, backend)

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, scale) as held (unpacked from fbgemm's layout when that backend packed them)."""
        if self._packed is None:
            return self.qweight, self.scale
        qtensor = torch.ops.quantized.linear_unpack(self._packed)[0]
        return qtensor.int_repr(), self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._packed is not None:
            y = _fbgemm_per_token(x2, self._packed, self.bias)
        elif self.backend == "triton":
            y = quantized_linear_triton(x2, self.qweight, self.scale, self.bias)
        else:
            y = quantized_linear_torch(x2, self.qweight, self.scale, self.bias)
        return y.view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode}, backend={self.backend}"
        )


def quantize_linear_layers(
    module: nn.Module, mode: str, skip: tuple[str, ...] = (), backend: str | None = None
) -> int:
    """Replace every `nn.Linear` under `module` (except those whose qualified name is in `skip`)
    by a `QuantizedLinear` of `mode`, one at a time so each float weight is freed as soon as its
    layer is quantized; returns how many were replaced. `mode` none replaces nothing."""
    if mode == "none":
        return 0
    replaced = 0
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, nn.Linear) and qualified not in skip:
                setattr(parent, name, QuantizedLinear.from_linear(child, mode, backend))
                replaced += 1
    return replaced
