"""The reference libraries' side of tooling/gptq_awq_checkpoints.py: GPTQ checkpoints written and
dequantized by GPTQModel's own code, AWQ ones by AutoAWQ's. Run only in a subprocess whose path
holds those libraries (`python -m tooling.gptq_awq_reference SPEC_JSON`, as
gptq_awq_checkpoints.py starts it): importing GPTQModel patches transformers and safetensors, so
it never enters the engine's own processes.

GPTQ (`write_gptq`), as GPTQModel's quantize-then-save path does it, calibration-free:
- scales and zero points per group by GPTQModel's native round-to-nearest quantizer (`RTN`, its
  `Quantizer.find_params` min-max); with `desc_act` the columns are first put in a random order
  and grouped in that order (GPTQ's act-order, the order drawn instead of taken from a Hessian:
  one order per input, so q/k/v and gate/up share theirs, as GPTQ's Hessian of their common
  input gives them), so `g_idx` interleaves the groups;
- per-module overrides from `dynamic` by GPTQModel's own `dynamic_get` (a negative match stays
  float);
- packing by `TorchLinear.pack_original` (zero points stored as is: GPTQModel's internal v2),
  then, for `format: gptq`, `convert_gptq_v2_to_v1_format_module` (stored zero points minus one,
  subtracted word-wise), as `pack_module` does before saving;
- config.json's `quantization_config` and quantize_config.json from `QuantizeConfig.to_dict()`,
  with the `meta` the writer adds (`save_quantized`).

AWQ (`write_awq`), as AutoAWQ's `AwqQuantizer._apply_quant` does it after its (here skipped)
scale search: the layer in float16, `pseudo_quantize_tensor` (zero-point min-max per group),
`WQLinear_GEMM.from_linear`; `quantization_config` from `AwqConfig.to_transformers_dict()`.

Every checkpoint gets, beside it (`<dir>.reference.safetensors`), the library's own dequantization
of each quantized layer's stored tensors as [out, in] weights: GPTQModel's
`PackableQuantLinear.dequantize_weight` on a `TorchLinear` loaded from the files (v1 zero points
converted by its `convert_gptq_v1_to_v2_format_module`, as its loader does), AutoAWQ's
`dequantize_gemm`; each in float16 (the libraries' scale dtype) as `<layer>.weight` and with the
scales upcast to float32 as `<layer>.weight@float32` (exact products: the float the integers
stand for).
"""

from __future__ import annotations

import json
import sys
import types
import zlib
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _float_model(source: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, local_files_only=True
    ).eval()


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' Linear modules by full name (what both libraries quantize)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    }


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _save(model: transformers.PreTrainedModel, source: str, out: Path, quantization_config: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = quantization_config
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            (out / name).write_bytes((Path(source) / name).read_bytes())


# --- GPTQ: GPTQModel ----------------------------------------------------------------------------


def _gptq_config(spec: dict):
    from gptqmodel.quantization.config import QuantizeConfig

    return QuantizeConfig(
        bits=spec["bits"],
        group_size=spec["group_size"],
        desc_act=spec["desc_act"],
        sym=spec["sym"],
        format=spec["format"],
        dynamic=spec.get("dynamic"),
        offload_to_disk=False,
    )


def _module_settings(qcfg, name: str) -> dict | None:
    """bits, group_size, desc_act, sym of module `name` (GPTQModel's `dynamic_get`, as its
    `create_quant_module` applies it); None where a negative rule leaves it in float."""
    settings = {"bits": qcfg.bits, "group_size": qcfg.group_size}
    settings.update(desc_act=qcfg.desc_act, sym=qcfg.sym)
    overrides = qcfg.dynamic_get(name) if qcfg.dynamic else None
    if overrides is False:
        return None
    for key in settings:
        if overrides and key in overrides:
            settings[key] = overrides[key]
    return settings


def _rtn_scales(weight: torch.Tensor, bits: int, group_size: int, sym: bool):
    """GPTQModel's RTN on `weight` [out, in]: (scale, zero) [out, groups] in column order."""
    from gptqmodel.quantization.config import RTNConfig
    from gptqmodel.quantization.rtn import RTN

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    rtn = RTN(linear, RTNConfig(bits=bits, group_size=group_size, sym=sym, offload_to_disk=False))
    _, scale, zero, _g_idx, *_ = rtn.quantize()
    return scale, zero


def write_gptq(spec: dict) -> None:
    from gptqmodel import __version__
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import (
        META_FIELD_QUANTIZER,
        META_FIELD_URI,
        META_QUANTIZER_GPTQMODEL,
        META_VALUE_URI,
    )
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    source, out = spec["source"], Path(spec["out"])
    qcfg = _gptq_config(spec)
    model = _float_model(source)
    packed = {}
    with torch.no_grad():
        for name, linear in _decoder_linears(model).items():
            s = _module_settings(qcfg, name)
            if s is None:
                continue
            k = linear.in_features
            group = s["group_size"] if s["group_size"] != -1 else k
            order = _act_order(name, k, spec.get("seed", 0)) if s["desc_act"] else torch.arange(k)
            if spec.get("zero_point_zero") and not s["sym"]:
                # Every 8th row's first group non-negative: its zero point is 0, which v1 stores
                # as -1 by a word-wise subtraction that borrows from the next value.
                rows, cols = torch.arange(0, linear.out_features, 8)[:, None], order[:group]
                linear.weight.data[rows, cols] = linear.weight.data[rows, cols].abs()
            weight = linear.weight.data.float()
            # Groups of consecutive columns in `order` (GPTQ's act-order), then g_idx in the
            # stored column order: column order[j] is in group j // group.
            scale, zero = _rtn_scales(weight[:, order], s["bits"], s["group_size"], s["sym"])
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = (torch.arange(k) // group).to(torch.int32)
            module = TorchLinear(
                bits=s["bits"],
                group_size=s["group_size"],
                sym=s["sym"],
                desc_act=s["desc_act"],
                in_features=k,
                out_features=linear.out_features,
                bias=linear.bias is not None,
                register_buffers=True,
            )
            module.pack_original(linear=linear, scales=scale, zeros=zero, g_idx=g_idx)
            if spec["format"] == "gptq":
                convert_gptq_v2_to_v1_format_module(module=module, quantize_config=qcfg)
            packed[name] = module
    for name, module in packed.items():
        _set_module(model, name, _GPTQTensors(module))
    qcfg.meta_set_versionable(
        key=META_FIELD_QUANTIZER, value=[f"{META_QUANTIZER_GPTQMODEL}:{__version__}"]
    )
    qcfg.meta_set(key=META_FIELD_URI, value=META_VALUE_URI)
    _save(model, source, out, qcfg.to_dict())
    qcfg.save_pretrained(str(out))
    _write_reference(out, _gptq_reference(out))


def _act_order(name: str, k: int, seed: int) -> torch.Tensor:
    """A random input order, the same for the projections that share an input."""
    head, _, proj = name.rpartition(".")
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up"}
    key = f"{head}.{shared.get(proj, 'gate_up' if proj == 'up_proj' else proj)}"
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randperm(k, generator=generator)


class _GPTQTensors(nn.Module):
    """The stored tensors of a packed GPTQModel layer (its state dict, nothing that computes)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        for name in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            tensor = getattr(module, name, None)
            if tensor is not None:
                self.register_buffer(name, tensor.clone())


def _gptq_reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    qcfg = QuantizeConfig.from_quant_config(config)
    tensors = load_file(checkpoint / "model.safetensors")
    weights = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key.removesuffix(".qweight")
        s = _module_settings(qcfg, name)
        qweight, scales = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
        in_features = qweight.shape[0] * 32 // s["bits"]
        module = TorchLinear(
            bits=s["bits"],
            group_size=s["group_size"],
            sym=s["sym"],
            desc_act=s["desc_act"],
            in_features=in_features,
            out_features=qweight.shape[1],
            register_buffers=True,
        )
        module.qweight.copy_(qweight)
        module.qzeros.copy_(tensors[f"{name}.qzeros"])
        module.g_idx.copy_(tensors[f"{name}.g_idx"])
        if qcfg.format == "gptq":  # v1 zero points: GPTQModel's loader converts them to v2
            convert_gptq_v1_to_v2_format_module(module, bits=s["bits"], pack_dtype=torch.int32)
        for dtype in (torch.float16, torch.float32):
            module.scales = scales.to(dtype)
            weight = PackableQuantLinear.dequantize_weight(module).T.contiguous()
            suffix = "" if dtype == torch.float16 else "@float32"
            weights[f"{name}.weight{suffix}"] = weight
    return weights


# --- AWQ: AutoAWQ -------------------------------------------------------------------------------


def _import_autoawq() -> None:
    """AutoAWQ's modules without its package __init__ (which imports every model definition and
    the `datasets` library for calibration): the package and its calibration-data module are
    registered empty, everything used here is AutoAWQ's own code."""
    import importlib.util

    if "awq" in sys.modules:
        return
    spec = importlib.util.find_spec("awq")
    package = types.ModuleType("awq")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["awq"] = package
    calib = types.ModuleType("awq.utils.calib_data")
    calib.get_calib_dataset = None  # calibration is not run here
    sys.modules["awq.utils.calib_data"] = calib


def write_awq(spec: dict) -> None:
    _import_autoawq()
    from awq.models._config import AwqConfig
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.module import exclude_layers_to_not_quantize

    source, out = spec["source"], Path(spec["out"])
    config = AwqConfig(
        q_group_size=spec["group_size"],
        w_bit=4,
        zero_point=True,
        version="gemm",
        modules_to_not_convert=spec.get("modules_to_not_convert"),
    )
    quantizer = types.SimpleNamespace(
        w_bit=config.w_bit, group_size=config.q_group_size, zero_point=config.zero_point
    )
    model = _float_model(source)
    linears = exclude_layers_to_not_quantize(_decoder_linears(model), config.modules_to_not_convert)
    with torch.no_grad():
        for name, linear in linears.items():
            linear = linear.half()  # as _apply_quant: quantized in float16
            linear.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(
                quantizer, linear.weight.data
            )
            q_linear = WQLinear_GEMM.from_linear(
                linear=linear,
                w_bit=config.w_bit,
                group_size=config.q_group_size,
                init_only=False,
                scales=scales.t().contiguous(),
                zeros=zeros.t().contiguous(),
            )
            _set_module(model, name, q_linear)
    _save(model, source, out, config.to_transformers_dict())
    _write_reference(out, _awq_reference(out))


def _awq_reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    _import_autoawq()
    from awq.utils.packing_utils import dequantize_gemm

    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    tensors = load_file(checkpoint / "model.safetensors")
    weights = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key.removesuffix(".qweight")
        parts = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"]
        qweight, qzeros, scales = parts
        for dtype in (torch.float16, torch.float32):
            weight = dequantize_gemm(qweight, qzeros, scales.to(dtype), 4, config["group_size"])
            suffix = "" if dtype == torch.float16 else "@float32"
            weights[f"{name}.weight{suffix}"] = weight.T.contiguous()
    return weights


def _write_reference(checkpoint: Path, weights: dict[str, torch.Tensor]) -> None:
    # tooling/gptq_awq_checkpoints.py's reference_path: beside the checkpoint, not in it.
    save_file(weights, checkpoint.with_name(checkpoint.name + ".reference.safetensors"))


def main(argv: list[str]) -> None:
    """argv[0]: a JSON list of specs (tooling/gptq_awq_checkpoints.py's, with source and out)."""
    torch.set_num_threads(1)
    for spec in json.loads(argv[0]):
        {"gptq": write_gptq, "awq": write_awq}[spec["kind"]](spec)


if __name__ == "__main__":
    main(sys.argv[1:])
