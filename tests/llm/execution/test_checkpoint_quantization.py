"""Pre-quantized compressed-tensors checkpoints (issue 27): the Shakespeare model quantized by
compressed-tensors itself (tooling/quantized_checkpoints.py), loaded as stored.

- The dequantized weights of every quantized layer are bit-identical to compressed-tensors' own
  decompression, fused projections (q/k/v, gate/up) shard by shard.
- Greedy tokens equal transformers loading the same checkpoint (it decompresses weight-only
  checkpoints on CPU), with prefix-cache hits and chunked prefill.
- A corrupt or inconsistent checkpoint fails the load with a message naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.llm.execution.checkpoint_quantization.layers import StagingLinear, WNA16Linear
from backend_lib.llm.execution.loader import (
    load_model,
    read_checkpoint_info,
)
from backend_lib.quantization import QuantizedLinear
from kernels import kernel_ops
from tests.llm.engine_helpers import engine_checkpoint, greedy, make_engine, random_prompt
from tests.llm.quantized_checkpoint_helpers import (
    DENSE_ARCHITECTURES,
    PACKED_PRESETS,
    PRESETS,
    assert_bad_checkpoint_fails_the_load,
    assert_greedy_equals_hf_on_random_prompts,
    assert_greedy_equals_hf_with_chunks_and_a_prefix_hit,
    quantized_shakespeare,
    sonnet_prompts,
    staged_model,
)
from tooling import quantized_checkpoints
from tooling.hf_reference import hf_greedy
from tooling.quantized_checkpoints import reference_dequantized_weights

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_weights_are_compressed_tensors_own(preset):
    checkpoint = quantized_shakespeare(preset)
    reference = reference_dequantized_weights(checkpoint)
    model = staged_model(checkpoint)
    compared = set()
    for name, module in model.named_modules():
        if not isinstance(module, StagingLinear):
            continue
        param = f"{name}.weight"
        for shard in model.shards_of(param):
            ckpt_name = model.checkpoint_name(param, shard)
            expected = reference[ckpt_name]
            rows = model.shard_view(torch.arange(module.out_features)[:, None], param, shard)
            ours = module.dequantized(expected.dtype)[rows[:, 0]]
            assert torch.equal(ours, expected), ckpt_name
            compared.add(ckpt_name)
    # Every layer compressed-tensors quantized, and nothing else (lm_head is tied, so ignored).
    assert compared == set(reference) and len(compared) == 6 * 7


@pytest.mark.parametrize("preset", PRESETS)
def test_layers_compute_with_the_stored_weights(preset):
    """After loading, each quantized layer computes x @ W.T with W its dequantized weight."""
    checkpoint = quantized_shakespeare(preset)
    staged = staged_model(checkpoint)
    model = load_model(checkpoint, CPU, torch.float32, kernel_ops("torch"))
    layer = model.model.layers[1].self_attn.qkv_proj
    expected_type = {"W8A8_DYNAMIC": QuantizedLinear}.get(preset, WNA16Linear)
    if preset.startswith("FP8"):
        expected_type = QuantizedLinear  # weight-only fp8 where no fp8 GEMM runs (CPU)
    assert isinstance(layer, expected_type)
    weight = staged.model.layers[1].self_attn.qkv_proj.dequantized(torch.float32)
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x @ weight.T
    if preset == "W8A8_DYNAMIC":  # the activations are quantized too (per token, 7-bit): close
        assert (layer(x) - expected).norm() / expected.norm() < 3e-2
    else:
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sonnet_prompts(quantized_shakespeare("W4A16_G128"))


@pytest.mark.parametrize("preset", PACKED_PRESETS)
def test_greedy_tokens_equal_transformers_on_the_same_checkpoint(preset, prompts):
    from transformers import AutoModelForCausalLM

    checkpoint = quantized_shakespeare(preset)
    # transformers 5.24 reads asymmetric zero points only when it decompresses at load.
    options = {} if "ASYM" not in preset else {"quantization_config": _dequantize_at_load()}
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **options).eval()
    assert_greedy_equals_hf_with_chunks_and_a_prefix_hit(checkpoint, hf, prompts)


@pytest.mark.parametrize("arch", DENSE_ARCHITECTURES)
def test_each_dense_architecture_quantized_gives_transformers_greedy_tokens(arch, tmp_path):
    """Tiny random checkpoints (Qwen2's qkv bias, Qwen3's q/k norms, Gemma 2's soft-capping,
    Phi-3's fused checkpoint projections) at W4A16 group 32."""
    from transformers import AutoModelForCausalLM

    source, _ = engine_checkpoint(arch)
    scheme = quantized_checkpoints.with_group_size(quantized_checkpoints.W4A16_G128, 32)
    checkpoint = quantized_checkpoints.write_compressed_tensors_checkpoint(
        source, tmp_path / arch, scheme
    )
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert_greedy_equals_hf_on_random_prompts(checkpoint, hf, arch)


def test_a_quantized_output_head_loads_as_stored(tmp_path):
    """A checkpoint whose lm_head compressed-tensors quantized too (nothing ignored; untied head):
    the head loads as a 4-bit layer with compressed-tensors' own weights, and greedy tokens equal
    transformers' on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    source, _ = engine_checkpoint("LlamaForCausalLM")
    scheme = quantized_checkpoints.with_group_size(quantized_checkpoints.W4A16_G128, 32)
    scheme = quantized_checkpoints.with_head(scheme)
    checkpoint = quantized_checkpoints.write_compressed_tensors_checkpoint(
        source, tmp_path / "head", scheme
    )
    reference = reference_dequantized_weights(checkpoint)["lm_head.weight"]
    assert torch.equal(staged_model(checkpoint).lm_head.dequantized(reference.dtype), reference)
    model = load_model(checkpoint, CPU, torch.float32, kernel_ops("torch"))
    assert isinstance(model.lm_head, WNA16Linear)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert_greedy_equals_hf_on_random_prompts(checkpoint, hf, "LlamaForCausalLM")


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_mixture_of_experts_loads_its_quantized_attention_and_float_experts(arch, tmp_path):
    """compressed-tensors reaches only transformers' `Linear`s: attention is stored quantized, the
    fused experts in full precision (transformers itself cannot reload such a checkpoint here, so
    the reference is the float model with its quantized layers' dequantized weights)."""
    from transformers import AutoModelForCausalLM

    source, _ = engine_checkpoint(arch)
    scheme = quantized_checkpoints.with_group_size(quantized_checkpoints.W4A16_G128, 32)
    checkpoint = quantized_checkpoints.write_compressed_tensors_checkpoint(
        source, tmp_path / arch, scheme
    )
    reference = reference_dequantized_weights(checkpoint)
    assert any(".self_attn." in name for name in reference)
    assert not any(".experts." in name for name in reference)
    model = load_model(checkpoint, CPU, torch.float32, kernel_ops("torch"))
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WNA16Linear)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected
    prompt = random_prompt(9, 1)
    (out,) = make_engine(checkpoint).generate([prompt], greedy(8))
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)


def _dequantize_at_load():
    from transformers import CompressedTensorsConfig

    return CompressedTensorsConfig(dequantize=True)


def test_the_engine_reports_the_checkpoint_quantization():
    info = read_checkpoint_info(quantized_shakespeare("W4A16_G128"))
    assert info.quantization.describe() == (
        "compressed-tensors pack-quantized W4A16 group 128 symmetric, "
        "pack-quantized W4A16 group 64 symmetric"
    )


def test_own_quantization_of_a_quantized_checkpoint_is_refused():
    with pytest.raises(ConfigError, match="quantization.*pre-quantized.*set auto"):
        make_engine(quantized_shakespeare("W8A16_CHANNEL"), quantization="int8")


def _wna16_layers(engine) -> list[WNA16Linear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, WNA16Linear)]


def test_w4a16_activations_setting_reaches_the_4bit_layers():
    """auto: int8 activations in bfloat16 where the int8 dot runs (AVX2, or AVX512-VNNI), never
    in float32; an explicit bfloat16 keeps them; an explicit int8 takes them in float32 too, and
    where it cannot run is refused, naming the field."""
    from kernels.wna16_linear import wna16_int8_dot

    checkpoint = quantized_shakespeare("W4A16_G128")
    in_bf16 = make_engine(checkpoint, dtype="bfloat16")
    assert {m.dynamic_int8 for m in _wna16_layers(in_bf16)} == {wna16_int8_dot()}
    assert len(_wna16_layers(in_bf16)) == 6 * 4
    kept = make_engine(checkpoint, dtype="bfloat16", w4a16_activations="bfloat16")
    assert not any(m.dynamic_int8 for m in _wna16_layers(kept))
    assert not any(m.dynamic_int8 for m in _wna16_layers(make_engine(checkpoint)))  # float32
    if wna16_int8_dot():
        asked = make_engine(checkpoint, w4a16_activations="int8")  # float32
        assert all(m.dynamic_int8 for m in _wna16_layers(asked))
    else:
        with pytest.raises(ConfigError, match="w4a16_activations.*int8 activations need the CPU"):
            make_engine(checkpoint, w4a16_activations="int8")
    with pytest.raises(
        ConfigError, match="w4a16_activations.*expected one of auto, bfloat16, int8"
    ):
        make_engine(checkpoint, w4a16_activations="fp8")


# Bad checkpoints: each fails the load naming what is wrong.


Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("config_edit", "tensors_edit", "message"),
    [
        (
            lambda q: q.update(quant_method="bitsandbytes"),
            None,
            "quant_method 'bitsandbytes' is not supported",
        ),
        (
            lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
            None,
            "format 'nvfp4-pack-quantized' is not supported",
        ),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=96),
            None,
            "group size 96 does not divide in_features 256",
        ),
        (None, lambda t: t.pop(f"{Q_PROJ}.weight_scale"), f"{Q_PROJ}.weight_scale"),
        (
            None,
            lambda t: t.update(
                {f"{Q_PROJ}.weight_packed": t[f"{Q_PROJ}.weight_packed"][:, :-1].clone()}
            ),
            rf"{Q_PROJ}.weight_packed is torch.int32 \[256, 31\], expected torch.int32 \[256, 32\]",
        ),
        (
            None,
            lambda t: t.update(
                {f"{Q_PROJ}.weight_scale": t[f"{Q_PROJ}.weight_scale"][:, :1].clone()}
            ),
            rf"{Q_PROJ}.weight_scale has shape \[256, 1\], expected \[256, 2\]",
        ),
        (
            None,
            lambda t: t.update({f"{Q_PROJ}.weight_shape": torch.tensor([256, 128])}),
            rf"{Q_PROJ}.weight_shape is \[256, 128\], expected \[256, 256\]",
        ),
    ],
    ids=[
        "unknown-method",
        "unknown-format",
        "group-does-not-divide",
        "missing-scale",
        "packed-shape",
        "scale-shape",
        "weight-shape",
    ],
)
def test_a_bad_checkpoint_fails_the_load_naming_the_problem(
    tmp_path, config_edit, tensors_edit, message
):
    assert_bad_checkpoint_fails_the_load(
        quantized_shakespeare("W4A16_G128"), tmp_path, config_edit, tensors_edit, message
    )
