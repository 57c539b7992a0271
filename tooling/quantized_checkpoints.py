"""Pre-quantized checkpoints in compressed-tensors' format (what llm-compressor writes and vLLM
loads), made from a float Hugging Face checkpoint with compressed-tensors' own API: the config
applied with `apply_quantization_config`, min-max (round-to-nearest, calibration-free) weight
scales from its `calculate_qparams`, compression by `ModelCompressor.compress_model`, the
`quantization_config` written into config.json by `ModelCompressor.update_config`.

`reference_dequantized_weights` is the independent reference for a loader: compressed-tensors' own
decompression of every quantized weight of such a checkpoint.

    python -m tooling.quantized_checkpoints --source models/shakespeare-llama --out DIR \\
        --scheme W4A16_G128
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class CTScheme:
    """One compressed-tensors quantization of every Linear but `ignore`d ones.

    `format`: "pack-quantized" (int weights, 2-8 bits, packed in int32; weight-only: WnA16),
    "int-quantized" (int8 weights and dynamic per-token symmetric int8 input activations: W8A8) or
    "float-quantized" (FP8 e4m3 weights and dynamic per-token FP8 input activations: FP8_DYNAMIC).
    `strategy`: "group" (`group_size` input columns per scale), "channel" (a scale per output row)
    or "tensor" (one scale). `symmetric=False` adds zero points. `group_overrides`: (target,
    group_size) pairs, each its own config group (e.g. ("re:.*down_proj$", 64) where 128 does not
    divide the MLP width); a module's in_features must be a multiple of its group size."""

    format: str
    num_bits: int
    strategy: str
    group_size: int | None = None
    symmetric: bool = True
    ignore: tuple[str, ...] = ("lm_head",)
    group_overrides: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {FORMATS}")
        if self.format == "pack-quantized" and not 2 <= self.num_bits <= 8:
            raise ValueError(f"pack-quantized stores 2-8 bit weights, not {self.num_bits}")
        if self.format != "pack-quantized" and self.num_bits != 8:
            raise ValueError(f"{self.format} stores 8-bit weights, not {self.num_bits}")
        if self.strategy not in ("group", "channel", "tensor"):
            raise ValueError(f"unknown strategy {self.strategy!r}")
        if (self.strategy == "group") != (self.group_size is not None):
            raise ValueError("group_size goes with strategy 'group', and only with it")
        if self.group_overrides and self.strategy != "group":
            raise ValueError("group_overrides need strategy 'group'")

    def quantization_config(self):
        """The compressed-tensors `QuantizationConfig` to apply: the overrides' groups, then one of
        every Linear (a module matching both takes the override: compressed-tensors ranks an exact
        name over a regex over a class). The config written is rebuilt from the modules' schemes
        (`ModelCompressor.from_pretrained_model`): "Linear" comes first there."""
        from compressed_tensors.quantization import QuantizationConfig

        schemes = [self._scheme([target], size) for target, size in self.group_overrides]
        schemes.append(self._scheme(["Linear"], self.group_size))
        groups = {f"group_{i}": scheme for i, scheme in enumerate(schemes)}
        return QuantizationConfig(config_groups=groups, ignore=list(self.ignore))

    def _scheme(self, targets: list[str], group_size: int | None):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        kind = "float" if self.format == "float-quantized" else "int"
        weights = QuantizationArgs(
            num_bits=self.num_bits,
            type=kind,
            strategy=self.strategy,
            group_size=group_size,
            symmetric=self.symmetric,
        )
        inputs = None
        if self.format != "pack-quantized":
            inputs = QuantizationArgs(
                num_bits=8, type=kind, strategy="token", symmetric=True, dynamic=True
            )
        return QuantizationScheme(
            targets=targets, weights=weights, input_activations=inputs, format=self.format
        )


# compressed-tensors' / llm-compressor's presets, named for what they store. W4A16_G128 puts
# down_proj in a second config group of 64: the Shakespeare model's MLP width 704 = 11 * 64.
W4A16_G128 = CTScheme("pack-quantized", 4, "group", 128, group_overrides=(("re:.*down_proj$", 64),))
W4A16_G64_ASYM = CTScheme("pack-quantized", 4, "group", 64, symmetric=False)
W4A16_CHANNEL = CTScheme("pack-quantized", 4, "channel")
W8A16_CHANNEL = CTScheme("pack-quantized", 8, "channel")
W8A8_DYNAMIC = CTScheme("int-quantized", 8, "channel")
FP8_DYNAMIC = CTScheme("float-quantized", 8, "channel")
FP8_DYNAMIC_PER_TENSOR = CTScheme("float-quantized", 8, "tensor")
PRESETS = {name: value for name, value in globals().items() if isinstance(value, CTScheme)}


def with_head(scheme: CTScheme) -> CTScheme:
    """`scheme` with the output head quantized too (nothing ignored), as llama-quantize keeps a
    6-bit head in its 4-bit files and GPTQ's `lm_head: true` does: at 1B a bfloat16 head is ~19%
    of a 4-bit model's bytes a token. Only for an untied head (a tied one is the embedding)."""
    return replace(scheme, ignore=())


def with_group_size(scheme: CTScheme, group_size: int) -> CTScheme:
    """`scheme` with every module in groups of `group_size` (e.g. 32 for the tiny random
    checkpoints, whose in_features are 64 or 128)."""
    return replace(scheme, strategy="group", group_size=group_size, group_overrides=())


def write_compressed_tensors_checkpoint(source_dir: Path, out_dir: Path, scheme: CTScheme) -> Path:
    """Quantize the float checkpoint in `source_dir` (loaded in float32, so scales are float32) by
    `scheme` and save it to `out_dir` with its tokenizer files; returns `out_dir`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source_dir, dtype=torch.float32, local_files_only=True
    )
    if model.config.tie_word_embeddings and "lm_head" not in scheme.ignore:
        raise ValueError(
            f"{source_dir} ties its lm_head to the token embedding: quantize the head only when "
            "it is untied (keep 'lm_head' in the scheme's ignore)"
        )
    apply_quantization_config(model, scheme.quantization_config(), show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_module_quantized(module):
                _set_min_max_qparams(name, module)
                module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    for name in TOKENIZER_FILES:
        if (source_dir / name).is_file():
            shutil.copy(source_dir / name, out_dir / name)
    return out_dir


def _set_min_max_qparams(name: str, module: torch.nn.Module) -> None:
    """The weight's scale (and zero point) from its min and max per scale (llm-compressor's
    memoryless min-max observer), by compressed-tensors' `calculate_qparams`."""
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight
    if args.strategy == "group":
        if weight.shape[-1] % args.group_size:
            raise ValueError(
                f"{name}: in_features {weight.shape[-1]} is not a multiple of group size "
                f"{args.group_size}; give it another group (CTScheme.group_overrides)"
            )
        observed = weight.unflatten(-1, (-1, args.group_size))  # (out, groups, group_size)
    elif args.strategy == "channel":
        observed = weight.unsqueeze(1)  # (out, 1, in)
    else:
        observed = weight.reshape(1, -1)
    scale, zero_point = calculate_qparams(observed.amin(-1), observed.amax(-1), args)
    update_offload_parameter(module, "weight_scale", scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        zero_point = zero_point.reshape(module.weight_zero_point.shape)
        update_offload_parameter(module, "weight_zero_point", zero_point)


def read_quantization_config(checkpoint_dir: Path) -> dict:
    """config.json's `quantization_config` (what compressed-tensors wrote)."""
    return json.loads((Path(checkpoint_dir) / "config.json").read_text())["quantization_config"]


def reference_dequantized_weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized weight of `checkpoint_dir`, by
    checkpoint name ("model.layers.0.self_attn.q_proj.weight"), in the dtype it gives (the scales':
    float32 here). Each module gets its scheme as compressed-tensors matches it (an exact name,
    then a regex, then a class: down_proj takes "re:.*down_proj$" over "Linear"), on a weightless
    copy of the model, and its tensors go through its format's compressor's `decompress`."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized
    from safetensors.torch import load_file

    checkpoint_dir = Path(checkpoint_dir)
    qconfig = QuantizationConfig.model_validate(read_quantization_config(checkpoint_dir))
    config = transformers.AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    apply_quantization_config(model, qconfig, show_progress=False)
    tensors = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    weights = {}
    for name, module in model.named_modules():
        if not is_module_quantized(module):
            continue
        scheme = module.quantization_scheme
        compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
        state = {
            param: tensors[f"{name}.{param}"]
            for param in compressor.compression_param_names(scheme)
        }
        weights[f"{name}.weight"] = compressor.decompress(state, scheme)["weight"]
    return weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path("models/shakespeare-llama"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scheme", choices=sorted(PRESETS), default="W4A16_G128")
    parser.add_argument("--group-size", type=int, help="every module at this group size instead")
    args = parser.parse_args(argv)
    scheme = PRESETS[args.scheme]
    if args.group_size:
        scheme = with_group_size(scheme, args.group_size)
    out = write_compressed_tensors_checkpoint(args.source, args.out, scheme)
    print(f"{args.scheme} checkpoint written to {out}")


if __name__ == "__main__":
    main()
