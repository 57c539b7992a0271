"""tooling/quantized_checkpoints.py writes compressed-tensors checkpoints that hold what each
preset says (config.json's quantization_config, the safetensors' names, dtypes and shapes), are
round-to-nearest quantizations of the source weights, and that transformers loads and generates
from on CPU: the pack-quantized and int-quantized ones, and the FP8 ones too (transformers
decompresses them to float32 here; its FP8 matmul path is opt-in and needs a GPU of SM 8.9+)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tooling import quantized_checkpoints as qc
from tooling.checkpoints import build_checkpoint

SHAKESPEARE = Path(__file__).resolve().parents[2] / "models" / "shakespeare-llama"
LAYERS = 6
# Shakespeare model: (out, in) of each projection.
SHAPES = {
    "self_attn.q_proj": (256, 256),
    "self_attn.k_proj": (128, 256),
    "self_attn.v_proj": (128, 256),
    "self_attn.o_proj": (256, 256),
    "mlp.gate_proj": (704, 256),
    "mlp.up_proj": (704, 256),
    "mlp.down_proj": (256, 704),
}
MODULES = [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in SHAPES]
PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {
        name: qc.write_compressed_tensors_checkpoint(SHAKESPEARE, root / name, scheme)
        for name, scheme in qc.PRESETS.items()
    }


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(SHAKESPEARE, dtype=torch.float32)
    return model.state_dict()


def group_size(scheme: qc.CTScheme, module: str) -> int | None:
    overrides = scheme.group_overrides
    matching = (g for target, g in overrides if re.fullmatch(target.removeprefix("re:"), module))
    return next(matching, scheme.group_size)


def test_presets_are_the_documented_ones():
    assert set(qc.PRESETS) == {
        "W4A16_G128",
        "W4A16_G64_ASYM",
        "W4A16_CHANNEL",
        "W8A16_CHANNEL",
        "W8A8_DYNAMIC",
        "FP8_DYNAMIC",
        "FP8_DYNAMIC_PER_TENSOR",
    }


@pytest.mark.parametrize("name", sorted(qc.PRESETS))
def test_config_carries_the_quantization_config(written, name):
    scheme = qc.PRESETS[name]
    config = json.loads((written[name] / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["format"] == scheme.format
    assert quant["quantization_status"] == "compressed"
    assert quant["ignore"] == ["lm_head"]
    groups = list(quant["config_groups"].values())
    # The library orders the groups by first quantized module: "Linear" first, the overrides after.
    assert [g["targets"] for g in groups] == [["Linear"]] + [
        [target] for target, _ in scheme.group_overrides
    ]
    sizes = [scheme.group_size] + [g for _, g in scheme.group_overrides]
    for group, size in zip(groups, sizes, strict=True):
        assert group["format"] == scheme.format
        weights = group["weights"]
        assert weights["num_bits"] == scheme.num_bits
        assert weights["type"] == ("float" if scheme.format == "float-quantized" else "int")
        assert weights["strategy"] == scheme.strategy
        assert weights["group_size"] == size
        assert weights["symmetric"] == scheme.symmetric
        assert weights["dynamic"] is False
        inputs = group["input_activations"]
        if scheme.format == "pack-quantized":
            assert inputs is None
        else:
            assert (inputs["num_bits"], inputs["strategy"], inputs["dynamic"]) == (8, "token", True)
            assert inputs["type"] == weights["type"] and inputs["symmetric"] is True
    assert config["tie_word_embeddings"] is True
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (written[name] / file).read_bytes() == (SHAKESPEARE / file).read_bytes()


@pytest.mark.parametrize("name", sorted(qc.PRESETS))
def test_safetensors_hold_the_format_tensors(written, name):
    scheme = qc.PRESETS[name]
    tensors = load_file(written[name] / "model.safetensors")
    expected = {"model.embed_tokens.weight", "model.norm.weight"}  # lm_head is tied: not saved
    expected |= {
        f"model.layers.{i}.{norm}.weight"
        for i in range(LAYERS)
        for norm in ("input_layernorm", "post_attention_layernorm")
    }
    for module in MODULES:
        out, k = SHAPES[module.split(".", 3)[-1]]
        g = group_size(scheme, module)
        scales = (out, k // g) if scheme.strategy == "group" else (out, 1)
        if scheme.strategy == "tensor":
            scales = (1,)
        assert tensors[f"{module}.weight_scale"].dtype == torch.float32
        assert tensors[f"{module}.weight_scale"].shape == scales
        if scheme.format == "pack-quantized":
            names = ["weight_packed", "weight_scale", "weight_shape"]
            packed = tensors[f"{module}.weight_packed"]
            assert packed.dtype == torch.int32
            assert packed.shape == (out, k * scheme.num_bits // 32)
            assert tensors[f"{module}.weight_shape"].tolist() == [out, k]
            assert tensors[f"{module}.weight_shape"].dtype == torch.int64
            if not scheme.symmetric:
                names.append("weight_zero_point")
                zero_point = tensors[f"{module}.weight_zero_point"]
                # Packed like the weight, but along the output rows (dim 0).
                assert zero_point.dtype == torch.int32
                assert zero_point.shape == (math.ceil(out * scheme.num_bits / 32), scales[1])
        else:
            names = ["weight", "weight_scale"]
            dtype = torch.int8 if scheme.format == "int-quantized" else torch.float8_e4m3fn
            assert tensors[f"{module}.weight"].dtype == dtype
            assert tensors[f"{module}.weight"].shape == (out, k)
        expected |= {f"{module}.{n}" for n in names}
    assert set(tensors) == expected


def steps(tensors: dict[str, torch.Tensor], module: str, shape: tuple[int, int]) -> torch.Tensor:
    """Each weight element's quantization step: its scale, spread over its group."""
    scale = tensors[f"{module}.weight_scale"]
    return scale.repeat_interleave(shape[1] // scale.shape[-1], dim=-1).expand(shape)


INT_PRESETS = sorted(n for n, s in qc.PRESETS.items() if s.format != "float-quantized")
FLOAT_PRESETS = sorted(n for n, s in qc.PRESETS.items() if s.format == "float-quantized")


@pytest.mark.parametrize("name", INT_PRESETS)
def test_int_weights_are_rounded_to_nearest(written, original, name):
    """compressed-tensors' decompression of each weight is within half a step of the float
    weight, on the integer grid of its scale (and zero point), and not the float weight itself."""
    scheme = qc.PRESETS[name]
    reference = qc.reference_dequantized_weights(written[name])
    tensors = load_file(written[name] / "model.safetensors")
    assert set(reference) == {f"{m}.weight" for m in MODULES}
    for module in MODULES:
        dequantized, weight = reference[f"{module}.weight"], original[f"{module}.weight"]
        assert dequantized.dtype == torch.float32
        step = steps(tensors, module, weight.shape)
        assert ((dequantized - weight).abs() <= step * (0.5 + 1e-5)).all(), module
        assert not torch.equal(dequantized, weight)
        if scheme.symmetric:
            levels = dequantized / step
            assert torch.allclose(levels, levels.round(), atol=1e-3)
            limit = 2 ** (scheme.num_bits - 1)
            assert levels.round().min() >= -limit and levels.round().max() <= limit - 1


@pytest.mark.parametrize("name", FLOAT_PRESETS)
def test_fp8_weights_are_rounded_to_nearest(written, original, name):
    """Within half an e4m3 ulp (3 mantissa bits: |w|/16) of the float weight, or half the
    subnormal spacing (2^-10 steps) near zero."""
    reference = qc.reference_dequantized_weights(written[name])
    tensors = load_file(written[name] / "model.safetensors")
    for module in MODULES:
        dequantized, weight = reference[f"{module}.weight"], original[f"{module}.weight"]
        step = steps(tensors, module, weight.shape)
        bound = torch.maximum(weight.abs() / 16, step * 2**-10) * (1 + 1e-5)
        assert ((dequantized - weight).abs() <= bound).all(), module
        assert not torch.equal(dequantized, weight)


@pytest.mark.parametrize("name", sorted(qc.PRESETS))
def test_transformers_loads_and_generates(written, name):
    """transformers loads each checkpoint on CPU and greedy-generates; the weights it decompresses
    are compressed-tensors' reference bit for bit. transformers 5.24 cannot load an asymmetric
    pack-quantized checkpoint on its default path (it sizes the packed zero points unpacked),
    only with dequantize=True (fine with one config group; that path applies the first group to
    every module, so it breaks W4A16_G128's group-64 down_proj)."""
    path = written[name]
    kwargs = {}
    if not qc.PRESETS[name].symmetric:
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip()
    state = model.state_dict()  # decompressed by the first forward
    for key, value in qc.reference_dequantized_weights(path).items():
        assert torch.equal(state[key], value), key


ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_random_checkpoints_are_sources(tmp_path, arch):
    """tooling/checkpoints.py's tiny checkpoints (in_features 64 or 128) quantize at group 32."""
    build_checkpoint(arch, tmp_path / "float")
    scheme = qc.with_group_size(qc.W4A16_G128, 32)
    path = qc.write_compressed_tensors_checkpoint(tmp_path / "float", tmp_path / "w4", scheme)
    reference = qc.reference_dequantized_weights(path)
    assert len(reference) == 2 * 7
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[1, 5, 9]]), max_new_tokens=4, min_new_tokens=4, do_sample=False
        )
    assert out.shape == (1, 7)
    state = model.state_dict()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    if arch == "Qwen2ForCausalLM":  # biases stay float
        tensors = load_file(path / "model.safetensors")
        assert tensors["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32


def test_a_group_that_does_not_divide_in_features_is_refused(tmp_path):
    build_checkpoint("LlamaForCausalLM", tmp_path / "float")
    with pytest.raises(ValueError, match="in_features 64 is not a multiple of group size 128"):
        qc.write_compressed_tensors_checkpoint(tmp_path / "float", tmp_path / "q", qc.W4A16_G128)


def test_a_tied_head_is_not_quantized(tmp_path):
    """The Shakespeare model ties its head to the embedding: quantizing the head is refused."""
    with pytest.raises(ValueError, match="ties its lm_head"):
        qc.write_compressed_tensors_checkpoint(SHAKESPEARE, tmp_path, qc.with_head(qc.W4A16_G128))


def test_bad_schemes_are_refused():
    with pytest.raises(ValueError, match="8-bit"):
        qc.CTScheme("int-quantized", 4, "channel")
    with pytest.raises(ValueError, match="group_size"):
        qc.CTScheme("pack-quantized", 4, "group")
    with pytest.raises(ValueError, match="format"):
        qc.CTScheme("marlin", 4, "channel")


def test_cli(tmp_path, capsys):
    build_checkpoint("Qwen3ForCausalLM", tmp_path / "float")
    out = tmp_path / "q"
    source = ["--source", str(tmp_path / "float"), "--out", str(out)]
    qc.main([*source, "--scheme", "W4A16_CHANNEL", "--group-size", "32"])
    (group,) = qc.read_quantization_config(out)["config_groups"].values()
    assert (group["weights"]["strategy"], group["weights"]["group_size"]) == ("group", 32)
    assert str(out) in capsys.readouterr().out
