"""GPTQ and AWQ checkpoints (issue 27): the Shakespeare model written by GPTQModel and AutoAWQ
themselves (tooling/gptq_awq_checkpoints.py; GPTQ 4 and 8 bits, groups of 32 and 64 and per
channel, act-order on and off, symmetric and with zero points, v1 and v2 zero points, per-module
`dynamic` overrides; AWQ GEMM with and without `modules_to_not_convert`), loaded as stored.

- The dequantized weight of every quantized layer is bit-identical to the library's own
  dequantization of the stored tensors (float16, as the libraries compute, and float32).
- Greedy tokens equal transformers' on the float model with each quantized layer's weight replaced
  by the library's dequantization (transformers runs GPTQ and AWQ checkpoints only through
  optimum, GPTQModel or AutoAWQ, none of which can be in this venv), with chunked prefill and a
  prefix-cache hit.
- A corrupt or unsupported checkpoint fails the load with a message naming the tensor or key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend_lib.llm.execution.checkpoint_quantization.layers import WNA16Linear
from backend_lib.llm.execution.loader import (
    load_model,
    read_checkpoint_info,
)
from kernels import kernel_ops
from tests.llm.gptq_awq_checkpoint_helpers import PRESETS, gptq_awq_shakespeare, gptq_awq_tiny
from tests.llm.quantized_checkpoint_helpers import (
    DENSE_ARCHITECTURES,
    assert_bad_checkpoint_fails_the_load,
    assert_greedy_equals_hf_on_random_prompts,
    assert_greedy_equals_hf_with_chunks_and_a_prefix_hit,
    sonnet_prompts,
    staged_model,
    staged_weights,
)
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.gptq_awq_checkpoints import reference_dequantized_weights

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("single_torch_thread")

QUANTIZED_LAYERS = {
    # 6 decoder layers of 7 projections; the dynamic preset leaves layer 0's attention (4) in
    # float, the AWQ one skipping down_proj its 6 down projections.
    "GPTQ_W4_G64_DYNAMIC": 42 - 4,
    "AWQ_G32_NOT_DOWN_PROJ": 42 - 6,
}


@pytest.mark.sample(8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_weights_are_the_librarys_own(preset, dtype):
    checkpoint = gptq_awq_shakespeare(preset)
    reference = reference_dequantized_weights(checkpoint, dtype)
    ours = staged_weights(staged_model(checkpoint), dtype)
    assert ours.keys() == reference.keys()
    assert len(ours) == QUANTIZED_LAYERS.get(preset, 42)
    for name, expected in reference.items():
        assert torch.equal(ours[name], expected), name


def test_v1_zero_points_of_zero_are_read_back_across_the_borrow():
    """An asymmetric zero point of 0 is stored by v1 as -1 with a borrow from the next value of
    its word; the checkpoint has such zero points, and they load as 0 (the weights above are the
    library's, so the rest of their word is right too)."""
    model = staged_model(gptq_awq_shakespeare("GPTQ_W4_G32_ASYM_DESC_ACT"))
    zeros = model.model.layers[1].mlp.down_proj.zeros
    assert bool((zeros == 0).any())


@pytest.mark.parametrize(
    "preset", ["GPTQ_W4_G32_ASYM_DESC_ACT", "GPTQ_W8_G64_ASYM_DESC_ACT", "AWQ_G64"]
)
def test_layers_compute_with_the_stored_weights(preset):
    """After loading, each quantized layer computes x @ W.T with W its dequantized weight in the
    checkpoint's input order (act-order layers permute their input)."""
    checkpoint = gptq_awq_shakespeare(preset)
    staged = staged_model(checkpoint)
    model = load_model(checkpoint, CPU, torch.float32, kernel_ops("torch"))
    for path in ("self_attn.qkv_proj", "mlp.down_proj"):
        layer = model.model.layers[1].get_submodule(path)
        assert isinstance(layer, WNA16Linear)
        assert (layer.perm is not None) == ("DESC_ACT" in preset)
        weight = staged.model.layers[1].get_submodule(path).dequantized(torch.float32)
        x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-4, atol=1e-4)


def hf_with_the_librarys_weights(source: Path, checkpoint: Path):
    """transformers' float model of `source` with each quantized layer's weight replaced by the
    library's exact (float32) dequantization, and its bias by the stored one (the libraries store
    biases in float16)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = reference_dequantized_weights(checkpoint, torch.float32)
    stored = load_file(checkpoint / "model.safetensors")
    for name in list(state):
        bias = stored.get(name.removesuffix(".weight") + ".bias")
        if bias is not None:
            state[name.removesuffix(".weight") + ".bias"] = bias.float()
    _, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    return hf


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sonnet_prompts(SHAKESPEARE)


@pytest.mark.parametrize(
    "preset",
    ["GPTQ_W4_G64", "GPTQ_W4_G32_ASYM_DESC_ACT", "GPTQ_W4_G64_DYNAMIC", "AWQ_G64"],
)
def test_greedy_tokens_equal_transformers_with_the_librarys_weights(preset, prompts):
    checkpoint = gptq_awq_shakespeare(preset)
    hf = hf_with_the_librarys_weights(SHAKESPEARE, checkpoint)
    assert_greedy_equals_hf_with_chunks_and_a_prefix_hit(checkpoint, hf, prompts)


@pytest.mark.parametrize("method", ["GPTQ", "AWQ"])
@pytest.mark.parametrize("arch", DENSE_ARCHITECTURES)
def test_each_dense_architecture_gives_transformers_greedy_tokens(arch, method):
    """Tiny random checkpoints (Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 2's soft-capping,
    Phi-3's fused checkpoint projections) in GPTQ (4 bits, group 32, act-order, zero points) and
    AWQ (group 32): weights bit-identical to the library's, greedy tokens equal."""
    source, checkpoint = gptq_awq_tiny(arch, method)
    reference = reference_dequantized_weights(checkpoint, torch.float32)
    assert staged_weights(staged_model(checkpoint), torch.float32).keys() == reference.keys()
    for name, weight in staged_weights(staged_model(checkpoint), torch.float32).items():
        assert torch.equal(weight, reference[name]), name
    hf = hf_with_the_librarys_weights(source, checkpoint)
    assert_greedy_equals_hf_on_random_prompts(checkpoint, hf, arch)


def test_the_engine_reports_the_checkpoint_quantization():
    describe = {
        p: read_checkpoint_info(gptq_awq_shakespeare(p)).quantization.describe()
        for p in (
            "GPTQ_W4_G32_ASYM_DESC_ACT",
            "GPTQ_W4_G64_DYNAMIC",
            "AWQ_G64",
        )
    }
    assert describe == {
        "GPTQ_W4_G32_ASYM_DESC_ACT": (
            "gptq W4A16 group 32 asymmetric desc_act, checkpoint_format gptq"
        ),
        "GPTQ_W4_G64_DYNAMIC": (
            "gptq W4A16 group 64 symmetric, W8A16 group 32 asymmetric, checkpoint_format gptq"
        ),
        "AWQ_G64": "awq W4A16 group 64 asymmetric, version gemm",
    }


# Bad checkpoints: each fails the load naming what is wrong.

Q_PROJ = "model.layers.1.self_attn.q_proj"
K_PROJ = "model.layers.1.self_attn.k_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"


def _replace(name: str, make):
    return lambda t: t.update({name: make(t[name])})


def _reversed_groups(g_idx: torch.Tensor) -> torch.Tensor:
    return (g_idx.max() - g_idx).contiguous()


GPTQ_CASES = {
    "missing-qzeros": (None, lambda t: t.pop(f"{Q_PROJ}.qzeros"), rf"{Q_PROJ}\.qzeros"),
    "missing-g_idx": (None, lambda t: t.pop(f"{Q_PROJ}.g_idx"), rf"{Q_PROJ}\.g_idx"),
    "qweight-shape": (
        None,
        _replace(f"{Q_PROJ}.qweight", lambda w: w[:-1].clone()),
        rf"{Q_PROJ}\.qweight is torch.int32 \[31, 256\], expected torch.int32 \[32, 256\]",
    ),
    "qzeros-shape": (
        None,
        _replace(f"{Q_PROJ}.qzeros", lambda w: w[:, :-1].clone()),
        rf"{Q_PROJ}\.qzeros is torch.int32 \[8, 31\], expected torch.int32 \[8, 32\]",
    ),
    "scales-shape": (
        None,
        _replace(f"{Q_PROJ}.scales", lambda w: w[:1].clone()),
        rf"{Q_PROJ}\.scales is torch.float16 \[1, 256\], expected a float dtype \[8, 256\]",
    ),
    "g_idx-not-in-groups": (
        None,
        _replace(f"{Q_PROJ}.g_idx", lambda g: (g * 0).contiguous()),
        rf"{Q_PROJ}\.g_idx does not put 32 inputs in each of the 8 groups",
    ),
    "fused-g_idx-differ": (
        None,
        _replace(f"{K_PROJ}.g_idx", _reversed_groups),
        r"model\.layers\.1\.self_attn\.[qk]_proj and model\.layers\.1\.self_attn\.[qk]_proj are "
        "fused into one projection but order their inputs differently",
    ),
    "group-does-not-divide": (
        lambda q: q.update(group_size=96),
        None,
        "group size 96 does not divide in_features 256",
    ),
    "bits-3": (lambda q: q.update(bits=3), None, "GPTQ bits 3 is not supported; supported: 4, 8"),
    "marlin-format": (
        lambda q: q.update(format="marlin", checkpoint_format="marlin"),
        None,
        "GPTQ checkpoint format 'marlin' is not supported; supported: gptq, gptq_v2",
    ),
    "pack-dtype": (
        lambda q: q.update(pack_dtype="int16"),
        None,
        "GPTQ pack_dtype 'int16' is not supported",
    ),
    "dynamic-override": (
        lambda q: q.update(dynamic={"+:.*q_proj": {"adapter": {"rank": 8}}}),
        None,
        r"dynamic\['\+:\.\*q_proj'\] overrides adapter, which is not supported",
    ),
    "config-leaves-a-stored-layer-float": (
        lambda q: q.update(dynamic={r"-:.*\.1\.self_attn\.o_proj": {}}),
        None,
        rf"checkpoint tensor '{O_PROJ}\.\w+' is quantized, but the engine has no quantized",
    ),
}

AWQ_CASES = {
    "missing-qzeros": (None, lambda t: t.pop(f"{Q_PROJ}.qzeros"), rf"{Q_PROJ}\.qzeros"),
    "qweight-shape": (
        None,
        _replace(f"{Q_PROJ}.qweight", lambda w: w[:, :-1].clone()),
        rf"{Q_PROJ}\.qweight is torch.int32 \[256, 31\], expected torch.int32 \[256, 32\]",
    ),
    "group-does-not-divide": (
        lambda q: q.update(group_size=128),
        None,
        "group size 128 does not divide in_features 704",
    ),
    "gemv": (
        lambda q: q.update(version="gemv"),
        None,
        "AWQ version 'gemv' is not supported; supported: gemm",
    ),
    "gemv-fast": (
        lambda q: q.update(version="gemv_fast"),
        None,
        "AWQ version 'gemv_fast' is not supported",
    ),
    "no-zero-point": (
        lambda q: q.update(zero_point=False),
        None,
        "AWQ zero_point false is not supported",
    ),
    "modules-to-not-convert-a-stored-layer": (
        lambda q: q.update(modules_to_not_convert=["o_proj"]),
        None,
        r"checkpoint tensor 'model\.layers\.0\.self_attn\.o_proj\.\w+' is quantized, but",
    ),
}


@pytest.mark.parametrize("case", GPTQ_CASES)
def test_a_bad_gptq_checkpoint_fails_the_load_naming_the_problem(tmp_path, case):
    checkpoint = gptq_awq_shakespeare("GPTQ_W4_G32_ASYM_DESC_ACT")
    assert_bad_checkpoint_fails_the_load(checkpoint, tmp_path, *GPTQ_CASES[case])


@pytest.mark.parametrize("case", AWQ_CASES)
def test_a_bad_awq_checkpoint_fails_the_load_naming_the_problem(tmp_path, case):
    assert_bad_checkpoint_fails_the_load(
        gptq_awq_shakespeare("AWQ_G64"), tmp_path, *AWQ_CASES[case]
    )


def test_which_modules_a_gptq_config_quantizes():
    """lm_head only with `lm_head: true`; optimum's `modules_in_block_to_quantize` lists a block's
    quantized modules; GPTQModel's `dynamic` rules apply in order, first match winning."""
    from backend_lib.llm.execution.checkpoint_quantization import read_checkpoint_quantization

    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.up_proj"]],
        "dynamic": {r"-:.*\.3\.self_attn\.q_proj": {}, r".*\.3\..*": {"bits": 8, "sym": False}},
    }
    fmt = read_checkpoint_quantization({"quantization_config": config})
    bits = {
        name: None if (s := fmt.scheme_for(f"model.layers.{name}")) is None else s.num_bits
        for name in ("0.self_attn.q_proj", "0.self_attn.v_proj", "0.mlp.up_proj", "0.mlp.down_proj")
        + ("3.self_attn.q_proj", "3.self_attn.k_proj")
    }
    assert bits == {
        "0.self_attn.q_proj": 4,
        "0.self_attn.v_proj": None,
        "0.mlp.up_proj": 4,
        "0.mlp.down_proj": None,
        "3.self_attn.q_proj": None,
        "3.self_attn.k_proj": 8,
    }
    assert fmt.scheme_for("lm_head") is None
    assert (
        read_checkpoint_quantization(
            {"quantization_config": {**config, "lm_head": True}}
        ).scheme_for("lm_head")
        is not None
    )
