"""The layers of a pre-quantized checkpoint: staged while loading, then the layers that compute.

Loading a quantized checkpoint (loader.py):

1. `install_staging_layers` replaces, on the meta device, each `nn.Linear` whose checkpoint layers
   are quantized by a `StagingLinear` holding empty staging tensors (scheme.py), and returns the
   expected shape of every quantized checkpoint layer (for the format's checks).
2. The model's `load_weights` fills the staging tensors from the format's translated stream, fused
   projections shard by shard along their rows, as it fills float weights. A GPTQ act-order layer
   also has an input order (`<module>.perm`, int64 [K]: the staged weight's column j is input
   perm[j]), which is not indexed by row: `take_input_permutations` hands it to its layer
   directly, checking that the layers fused into one projection agree.
3. `finalize_quantized_layers` replaces every `StagingLinear` by the layer that computes:
   `WNA16Linear` (int weights, 16/32-bit activations), `QuantizedLinear` int8 (W8A8 dynamic:
   fbgemm's per-token int8 GEMM on CPU) or fp8 (`Fp8Linear` where the GPU has fp8 GEMMs, else the
   dequantizing `QuantizedLinear`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from backend_lib.config import ConfigError
from backend_lib.llm.execution.checkpoint_quantization.scheme import (
    CheckpointFormatError,
    LayerShape,
    WeightScheme,
)
from backend_lib.quantization import FP8_MAX, QuantizedLinear
from kernels import wna16_linear as wna16

SchemeLookup = Callable[[str], WeightScheme | None]


def _staging(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


class StagingLinear(nn.Module):
    """A quantized linear's staging tensors (scheme.py's layouts) while the checkpoint loads."""

    def __init__(self, linear: nn.Linear, scheme: WeightScheme):
        super().__init__()
        self.scheme = scheme
        n, k = self.out_features, self.in_features = linear.out_features, linear.in_features
        if scheme.kind == "wna16":
            groups = k // scheme.group_size_for(k)
            self.qweight = _staging((n, k * scheme.num_bits // 32), torch.int32)
            self.scales = _staging((n, groups), torch.float32)
            self.zeros = _staging((n, groups), torch.uint8)
            self.mins = _staging((n, groups), torch.float32) if scheme.float_mins else None
        else:
            dtype = torch.int8 if scheme.kind == "int8_dynamic" else torch.float8_e4m3fn
            self.qweight = _staging((n, k), dtype)
            self.scales = _staging((n, 1), torch.float32)
            self.zeros = self.mins = None
        has_bias = linear.bias is not None
        self.bias = _staging((n,), linear.bias.dtype) if has_bias else None
        self.perm: torch.Tensor | None = None
        """The input order (wna16 only; None: inputs in order); see the module docstring."""
        self._perm_source: str | None = None

    def set_input_permutation(self, name: str, perm: torch.Tensor) -> None:
        """Checkpoint tensor `name`'s input order for this layer; CheckpointFormatError when a
        layer fused into the same projection gave another."""
        if perm.dtype != torch.int64 or tuple(perm.shape) != (self.in_features,):
            raise CheckpointFormatError(
                f"{name} is {perm.dtype} {list(perm.shape)}, expected torch.int64 "
                f"{[self.in_features]}"
            )
        if self.perm is None:
            self.perm, self._perm_source = perm, name
        elif not torch.equal(self.perm, perm):
            raise CheckpointFormatError(
                f"{self._perm_source.rpartition('.')[0]} and {name.rpartition('.')[0]} are fused "
                "into one projection but order their inputs differently (their act-order g_idx "
                "differ); they share an input, so a checkpoint quantized from it has one order"
            )

    def _mins(self) -> torch.Tensor | None:
        return None if self.mins is None else self.mins.data

    def _input_order(self) -> torch.Tensor | None:
        """`perm`, or None where it is the identity."""
        if self.perm is None:
            return None
        identity = torch.arange(self.in_features, device=self.perm.device)
        return None if torch.equal(self.perm, identity) else self.perm

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] the staged tensors stand for, computed in float32 and rounded
        once to `dtype` (as compressed-tensors' own decompression in a `dtype` scale does: the
        products of small integers and such a scale are exact in float32)."""
        q, scales = self.qweight.data, self.scales.data
        if self.scheme.kind == "wna16":
            group = self.scheme.group_size_for(self.in_features)
            weight = wna16.dequantize_wna16(
                q, scales, self.zeros.data, group, self.scheme.num_bits, mins=self._mins()
            )
            perm = self._input_order()
            if perm is not None:  # back to the checkpoint's input order
                weight = torch.empty_like(weight).index_copy_(1, perm, weight)
        else:
            weight = q.float() * scales
        return weight.to(dtype)

    def finalize(self, dynamic_int8: bool = False) -> nn.Module:
        """The layer that computes with the loaded tensors; `dynamic_int8`: a 4-bit layer's
        activations are quantized to int8 per call (`WNA16Linear`)."""
        q, scales = self.qweight.data, self.scales.data
        bias = None if self.bias is None else self.bias.data
        if self.scheme.kind == "wna16":
            group = self.scheme.group_size_for(self.in_features)
            bits, perm = self.scheme.num_bits, self._input_order()
            zeros, mins = self.zeros.data, self._mins()
            return WNA16Linear(q, scales, zeros, group, bits, bias, perm, dynamic_int8, mins)
        if self.scheme.kind == "int8_dynamic":
            return QuantizedLinear(q, scales[:, 0], bias, "int8")
        if Fp8Linear.runs_on(q.device) and self.scheme.dynamic_activations:
            return Fp8Linear(q, scales[:, 0], bias)
        # Weight-only fp8 everywhere else: the Triton kernel on CUDA, the dequantizing twin on CPU.
        return QuantizedLinear(q, scales[:, 0], bias, "fp8")


def install_staging_layers(
    model: nn.Module, scheme_for: SchemeLookup, skip: tuple[str, ...] = ()
) -> dict[str, LayerShape]:
    """Replace each `nn.Linear` of `model` (still on the meta device) whose checkpoint layers are
    quantized by a `StagingLinear`. Returns checkpoint layer name -> its expected shape.

    `scheme_for` maps a checkpoint layer name ("model.layers.0.self_attn.q_proj") to its scheme;
    the model's `shards_of` / `checkpoint_name` / `shard_view` say which checkpoint layers fill a
    fused projection; modules named in `skip` stay as they are. Raises CheckpointFormatError when the layers fused into one projection are
    quantized differently, or a layer's shape cannot hold its scheme.
    """
    layers: dict[str, LayerShape] = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) or qualified in skip:
                continue
            param = f"{qualified}.weight"
            shards = {
                model.checkpoint_name(param, s).removesuffix(".weight"): s
                for s in model.shards_of(param)
            }
            schemes = {scheme_for(name) for name in shards}
            if schemes == {None}:
                continue
            if len(schemes) > 1:
                raise CheckpointFormatError(
                    f"{', '.join(shards)} are fused into one projection but are not quantized alike"
                )
            scheme = schemes.pop()
            _check_shape(param, child.in_features, scheme)
            for name, shard in shards.items():
                rows = model.shard_view(child.weight, param, shard).shape[0]
                layers[name] = LayerShape(scheme, rows, child.in_features)
            setattr(parent, child_name, StagingLinear(child, scheme))
    return layers


def _check_shape(param: str, in_features: int, scheme: WeightScheme) -> None:
    group = scheme.group_size_for(in_features)
    if scheme.kind == "wna16" and (in_features % group or group % (32 // scheme.num_bits)):
        raise CheckpointFormatError(
            f"{param}: group size {group} does not divide in_features {in_features} "
            f"in whole int32 words of {scheme.num_bits}-bit values"
        )


def take_input_permutations(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` less the input orders (`<checkpoint module>.perm`), each given to the
    `StagingLinear` it belongs to (found by the model's `fused_target`); runs as the model's
    `load_weights` consumes it."""
    for name, tensor in weights:
        if not name.endswith(".perm"):
            yield name, tensor
            continue
        target, _shard = model.fused_target(name)
        layer = model.get_submodule(target.removesuffix(".perm"))
        if not isinstance(layer, StagingLinear) or layer.scheme.kind != "wna16":
            raise CheckpointFormatError(f"{name}: {target} is not a quantized int layer")
        layer.set_input_permutation(name, tensor)


def resolve_w4a16_activations(setting: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 4-bit layers quantize their activations to int8 (the `w4a16_activations`
    setting, LLMConfig); ConfigError naming it for int8 where that cannot run."""
    runs = device.type == "cpu" and wna16.wna16_int8_dot()
    if setting == "int8" and not runs:
        raise ConfigError(
            "w4a16_activations",
            setting,
            "int8 activations need the CPU and its C++ kernels built for AVX2, or for AVX-512 on a "
            f"CPU with AVX512-VNNI (here: {device.type}); use auto or bfloat16",
        )
    # auto: int8 in bfloat16 only; float32 stays the exact products unless int8 is asked for.
    return setting == "int8" or (setting == "auto" and runs and dtype == torch.bfloat16)


def finalize_quantized_layers(model: nn.Module, dynamic_int8: bool = False) -> int:
    """Replace every `StagingLinear` under `model` by its computing layer; returns how many.
    `dynamic_int8`: see `StagingLinear.finalize`."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, StagingLinear):
                setattr(parent, name, child.finalize(dynamic_int8))
                replaced += 1
    return replaced


class WNA16Linear(nn.Module):
    """`x @ W.T + bias` with 4- or 8-bit integer weights (kernels/wna16_linear.py's layout and
    contract), activations in the model dtype. Backend: the Triton kernel on CUDA; on CPU the C++
    kernel (its weights prepared once, here) where the extension is built, else the PyTorch twin.
    `perm` (int64 [K], optional): the weight's column j multiplies input perm[j], so the kernel
    computes on x[:, perm] (GPTQ act-order). `dynamic_int8`: on the C++ kernel, 4-bit weights
    take the op's dynamic int8 activations (`wna16_linear_int8_torch`'s contract).
    `mins` (float32 [N, K / group_size], optional): float minimums subtracted after scaling; the
    C++ kernel takes them folded into its zero points where it can (`cpu_folds_mins`), else the
    twin computes."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bits: int,
        bias: torch.Tensor | None,
        perm: torch.Tensor | None = None,
        dynamic_int8: bool = False,
        mins: torch.Tensor | None = None,
    ):
        super().__init__()
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * 32 // bits
        self.group_size, self.bits = group_size, bits
        self.bias, self.perm = bias, perm
        # Plain attributes, not parameters: never in a state dict, never cast by `.to(dtype)`.
        self.qweight, self.scales, self.zeros, self.mins = qweight, scales, zeros, mins
        self._prepared = None
        if qweight.device.type == "cuda":
            self.backend = "triton"
        elif wna16.wna16_cpu_takes(scales) and (mins is None or wna16.cpu_folds_mins(scales, mins)):
            self.backend = "cpu"
            self._prepared = wna16.prepare_wna16_cpu(
                qweight, scales, zeros, group_size, bits, mins=mins
            )
            # The prepared copy is the one used.
            self.qweight = self.scales = self.zeros = self.mins = None
        else:
            self.backend = "torch"
        self.dynamic_int8 = dynamic_int8 and self.backend == "cpu" and bits == 4

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight, its scales and zero points (as loaded)."""
        held = tuple(t for t in (self.qweight, self.scales, self.zeros, self.mins) if t is not None)
        if self._prepared is not None:
            held = (self._prepared.packed, self._prepared.scales, self._prepared.zeros)
        return sum(t.numel() * t.element_size() for t in held)

    def call_2d(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for the models' flattened [T, K] activations, bound once (models/llama.py's
        `_projection`): on the C++ kernel, the op itself with its weight arguments fixed
        (`WNA16Call`), which saves the entry's checks (~10 us a call, 4 calls a layer)."""
        if self._prepared is None or self.perm is not None:
            return self.forward
        return WNA16Call(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self._prepared is not None:
            if wna16.wna16_cpu_takes(x2):
                rows = wna16.gemm_min_rows(x2.dtype, self.dynamic_int8)
                y = wna16.wna16_linear_cpu(
                    x2, self._prepared, self.bias, rows, dynamic_int8=self.dynamic_int8
                )
            else:  # e.g. float16 activations: the op computes in float32 or bfloat16
                y = wna16.wna16_linear_cpu(x2.float(), self._prepared, self.bias).to(x.dtype)
        else:
            run = (
                wna16.wna16_linear_triton if self.backend == "triton" else wna16.wna16_linear_torch
            )
            y = run(
                x2,
                self.qweight,
                self.scales,
                self.zeros,
                self.group_size,
                self.bits,
                self.bias,
                **({} if self.mins is None else {"mins": self.mins}),
            )
        return y.view(*leading, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, backend={self.backend}"
            + (", input_permuted=True" if self.perm is not None else "")
            + (", dynamic_int8=True" if self.dynamic_int8 else "")
        )


class WNA16Call:
    """A C++-kernel `WNA16Linear` on [T, K] activations (`call_2d`): `llm_cpu::wna16_linear` with
    the layer's prepared weights bound; other inputs (a dtype the op does not compute in, strided
    rows) go through the layer's `forward`. Its `operands` are what models/decode_layers.py passes
    the C++ layer loop, which makes the same call."""

    def __init__(self, layer: WNA16Linear):
        prepared = layer._prepared
        self.tensors = (prepared.packed, prepared.scales, prepared.zeros)
        """`WNA16CPUWeight`'s packed words, scales and zero points (kernels/wna16_linear.py)."""
        self.bits, self.group_size, self.out_features = (
            layer.bits,
            layer.group_size,
            layer.out_features,
        )
        self.bias, self.dynamic_int8 = layer.bias, layer.dynamic_int8
        self.gemm_min_rows = {
            t: wna16.gemm_min_rows(t, layer.dynamic_int8) for t in (torch.float32, torch.bfloat16)
        }
        """Per activation dtype: the rows from which the op dequantizes and runs a GEMM."""
        self._op, self._forward = torch.ops.llm_cpu.wna16_linear.default, layer.forward
        self._args = (*self.tensors, self.bits, self.group_size, self.out_features, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.gemm_min_rows.get(x.dtype)
        if rows is not None and x.dim() == 2 and x.stride(1) == 1:
            return self._op(x, *self._args, rows, self.dynamic_int8)
        return self._forward(x)

    def operands(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
        """(packed, scales, zeros), (n, bits, group_size, gemm_min_rows, dynamic_int8): the op's
        arguments for activations of `dtype` (float32 or bfloat16)."""
        ints = [self.out_features, self.bits, self.group_size, self.gemm_min_rows[dtype]]
        return list(self.tensors), [*ints, int(self.dynamic_int8)]


class Fp8Linear(nn.Module):
    """FP8 W8A8: float8_e4m3fn weights with per-row scales, activations quantized per token at run
    time, multiplied by PyTorch's scaled matmul (`torch._scaled_mm`, GPUs of compute capability 8.9
    or newer), output in the input's dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        # [K, N] column-major, the layout `_scaled_mm` takes for its second operand.
        self.weight_t = qweight.t()
        self.scale_b = scale.float().reshape(1, -1).contiguous()
        self.bias = bias

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return (
            device.type == "cuda"
            and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        scale_a = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12) / FP8_MAX
        xq = (x2 / scale_a).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = torch._scaled_mm(
            xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b, bias=bias, out_dtype=x.dtype
        )
        return y.view(*leading, self.out_features)
