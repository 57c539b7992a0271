"""GGUF checkpoints: the default Shakespeare model written as GGUF with the `gguf` package (as
llama.cpp's converter lays it out, tooling/gguf_checkpoints.py) loads with `model: <file>.gguf`,
and greedy tokens equal transformers' on the same file (`gguf_file=`) for F32, F16 and BF16
tensors (and the original checkpoint's for F32), for quantized projections, loaded as stored,
mixed as llama.cpp's K-quant files mix them, and for a quantized embedding; every quantized
type's weights are bit-identical to `gguf.quants.dequantize`; other tensor types and a cut-short
file are refused at load, naming the tensor and its type. Random Qwen2, Qwen3, Gemma 2, Gemma 3
and Phi-3 checkpoints, written as llama.cpp writes each, give transformers' tokens too, in F32
(the checkpoint's own tokens) and K-quant mixed (every projection loaded as stored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from backend_lib.config import ConfigError
from backend_lib.gguf_checkpoint import PACKED_TYPES, materialize
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.llm.execution.checkpoint_quantization import read_checkpoint_quantization
from kernels.wna16_linear import dequantize_wna16
from tests.llm.engine_helpers import greedy
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.gguf_checkpoints import FAMILIES, build_family_checkpoint, write_gguf
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
NUM_TOKENS = 16


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The converted checkpoints' cache, one per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "triton-llm" / "gguf"


def engine_on(path: Path) -> LLMEngine:
    config = LLMConfig(
        model=str(path), dtype="float32", kernel_backend="torch", num_blocks=64, max_model_len=256
    )
    config.validate()
    return LLMEngine.from_config(config, path.parent, torch.device("cpu"))


def generate_and_check(path: Path) -> tuple[list[int], PreTrainedModel]:
    """The engine's greedy tokens on the GGUF file at `path`, checked equal to transformers' on
    the same file (prompt ids from its tokenizer, then `generate`), and transformers' model."""
    engine = engine_on(path)
    try:
        (out,) = engine.generate([PROMPT], greedy(NUM_TOKENS))
    finally:
        engine.close()
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    assert out.prompt_token_ids == AutoTokenizer.from_pretrained(**source)(PROMPT).input_ids
    reference = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, NUM_TOKENS)
    return out.outputs[0].token_ids, reference


@pytest.mark.sample(3)  # the quantized types run in the mix tests below
@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_a_float_gguf_gives_transformers_tokens_on_the_same_file(tensor_type, tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / f"shakespeare-{tensor_type}.gguf", tensor_type)
    tokens, _ = generate_and_check(path)
    if tensor_type == "F32":  # the file holds the checkpoint's own values
        assert _checkpoint_greedy(SHAKESPEARE) == tokens
    assert len(list(cache.iterdir())) == 1


def _checkpoint_greedy(checkpoint: Path) -> list[int]:
    """transformers' greedy tokens on the Hugging Face checkpoint `checkpoint` itself."""
    original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(checkpoint)(PROMPT).input_ids
    return hf_greedy(original, ids, NUM_TOKENS)


def test_a_second_load_reuses_the_converted_checkpoint(tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", "F16")
    engine_on(path).close()
    (converted,) = cache.iterdir()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    engine_on(path).close()
    assert [p.name for p in cache.iterdir()] == [converted.name]
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.sample(3)  # every type's blocks: tests/llm/execution/test_gguf_quants.py
@pytest.mark.parametrize("tensor_type", PACKED_TYPES)
def test_quantized_projections_load_as_stored_and_dequantize_as_gguf_does(
    tensor_type, tmp_path, cache
):
    """The converted checkpoint stores each projection's values, scales, zero points and
    minimums (`quant_method: gguf`), and its weights as the engine dequantizes them equal, bit for
    bit, gguf's dequantization of the file (through transformers, which also undoes llama.cpp's
    rotary row order). K-quants fall back, as llama.cpp does, where rows are not whole
    256-value super-blocks (ffn_down here)."""
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", tensor_type)
    converted = materialize(path, str(path))
    config = json.loads((converted / "config.json").read_text())
    quantization = read_checkpoint_quantization(config)
    assert quantization.describe().startswith("gguf ") and tensor_type in quantization.describe()
    ours = _dequantized(converted, config["quantization_config"]["layers"])
    source = {"pretrained_model_name_or_path": tmp_path, "gguf_file": path.name}
    gguf_values = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).state_dict()
    assert len(ours) == 7 * 6  # every projection of the 6 layers
    for name, weight in ours.items():
        assert torch.equal(weight, gguf_values[name]), name


def _dequantized(converted: Path, layers: dict) -> dict[str, torch.Tensor]:
    """Each quantized module's weight as the engine's twin dequantizes the stored tensors."""
    tensors = load_file(converted / "model.safetensors")
    weights = {}
    for module, spec in layers.items():
        mins = tensors.get(f"{module}.weight_min")
        weights[f"{module}.weight"] = dequantize_wna16(
            tensors[f"{module}.weight_packed"],
            tensors[f"{module}.weight_scale"],
            tensors[f"{module}.weight_zero"],
            spec["group_size"],
            spec["bits"],
            **({} if mins is None else {"mins": mins}),
        )
    return weights


MIXES = {
    # llama.cpp's Q4_K_M: attn_v and ffn_down one size up (ffn_down's rows fall back to Q8_0),
    # so q, k (Q4_K) and v (Q6_K), fused into one projection, share one layout; Phi-3's fused
    # attn_qkv in Q5_K; the embedding in Q8_0, loaded dequantized.
    "Q4_K_M": ({"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_qkv": "Q5_K"}, "Q4_K", "Q8_0"),
    "Q5_K_and_legacy": ({"attn_q": "Q4_1", "ffn_gate": "Q5_0", "ffn_down": "Q5_1"}, "Q5_K", "F32"),
    # A per-tensor F16 override of attn_v: q, k and v, fused, stay float together.
    "Q8_0_with_f16_v": ({"attn_v": "F16"}, "Q8_0", "F32"),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_k_quant_mix_gives_transformers_tokens_on_the_same_file(mix, tmp_path, cache):
    types, default, embedding = MIXES[mix]
    path = write_gguf(
        SHAKESPEARE, tmp_path / f"{mix}.gguf", types, embedding_type=embedding, default_type=default
    )
    generate_and_check(path)
    config = json.loads((materialize(path, str(path)) / "config.json").read_text())
    floats = 3 * 6 if types.get("attn_v") == "F16" else 0  # q, k, v of the 6 layers
    assert len(config["quantization_config"]["layers"]) == 7 * 6 - floats


@pytest.mark.parametrize(
    ("settings", "tensor"),
    [
        ({"tensor_type": "Q2_K"}, "blk.0.ffn_down.weight is Q2_K"),  # the first in the file
        ({"embedding_type": "Q2_K"}, "token_embd.weight is Q2_K"),
    ],
)
def test_another_tensor_type_is_refused_naming_the_tensor(settings, tensor, tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", **settings)
    with pytest.raises(ConfigError) as info:
        engine_on(path)
    assert info.value.key == "model"
    assert tensor in info.value.reason
    assert not cache.exists() or not any(cache.iterdir())


def test_a_cut_short_gguf_is_refused(tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", "F32")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ConfigError) as info:
        engine_on(path)
    assert info.value.key == "model"
    assert "cut short" in info.value.reason or "not a complete GGUF" in info.value.reason


@pytest.mark.sample(5)
@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("mix", ["Q4_K_M", "F32"])
def test_other_architectures_give_transformers_tokens_on_the_same_file(arch, mix, tmp_path, cache):
    """Qwen2 (q/k/v biases, no rotary row order), Qwen3 (q/k norms), Gemma 2 (norms stored as
    1 + w, four norms a layer, sliding windows), Gemma 3 (q/k norms too, five local layers to a
    global one, two rope bases) and Phi-3 (q/k/v and gate/up stored fused), written as llama.cpp
    writes them. In F32 the file holds the checkpoint's own model: its tokens are the
    checkpoint's too. K-quant mixed, every projection loads as stored, fused ones too, its
    weights bit for bit those transformers dequantizes."""
    source_dir = build_family_checkpoint(arch, tmp_path / arch)
    types = (
        {"tensor_type": "F32"}
        if mix == "F32"
        else {"tensor_type": MIXES[mix][0], "default_type": MIXES[mix][1]}
    )
    path = write_gguf(source_dir, tmp_path / f"{arch}-{mix}.gguf", **types)
    tokens, reference = generate_and_check(path)
    if mix == "F32":
        assert _checkpoint_greedy(source_dir) == tokens
        return
    converted = materialize(path, str(path))
    layers = json.loads((converted / "config.json").read_text())["quantization_config"]["layers"]
    ours = _dequantized(converted, layers)
    gguf_values = reference.state_dict()
    assert set(ours) == {name for name in gguf_values if name.endswith("_proj.weight")}
    for name, weight in ours.items():
        assert torch.equal(weight, gguf_values[name]), name


def test_an_untied_quantized_head_loads_as_stored(tmp_path, cache):
    """llama-quantize's Q4_0 layout: the projections in Q4_0, the untied output head in Q6_K
    (Phi-3's head is untied). The head loads as stored, an 8-bit container in groups of 16, its
    weights bit for bit those transformers dequantizes, and greedy tokens equal transformers'."""
    source_dir = build_family_checkpoint("Phi3ForCausalLM", tmp_path / "phi3")
    path = write_gguf(source_dir, tmp_path / "phi3-q4_0.gguf", "Q4_0", output_type="Q6_K")
    _, reference = generate_and_check(path)
    converted = materialize(path, str(path))
    layers = json.loads((converted / "config.json").read_text())["quantization_config"]["layers"]
    head = layers["lm_head"]
    assert (head["bits"], head["group_size"], head["tensor_types"]) == (8, 16, ["Q6_K"])
    ours = _dequantized(converted, {"lm_head": head})
    assert torch.equal(ours["lm_head.weight"], reference.state_dict()["lm_head.weight"])


def test_a_directory_with_gguf_file_loads_the_same_file(tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", "Q8_0")
    config = LLMConfig(
        model=str(tmp_path), gguf_file=path.name, dtype="float32", num_blocks=64, max_model_len=256
    )
    config.validate()
    engine = LLMEngine.from_config(config, tmp_path, torch.device("cpu"))
    try:
        (out,) = engine.generate([PROMPT], greedy(NUM_TOKENS))
    finally:
        engine.close()
    direct = engine_on(path)
    try:
        assert direct.generate([PROMPT], greedy(NUM_TOKENS))[0].outputs == out.outputs
    finally:
        direct.close()
    for name in ("../shakespeare.gguf", "shakespeare.bin", "missing.gguf"):
        bad = LLMConfig(model=str(tmp_path), gguf_file=name, num_blocks=64, max_model_len=256)
        with pytest.raises(ConfigError) as info:
            LLMEngine.from_config(bad, tmp_path, torch.device("cpu"))
        assert info.value.key == "gguf_file"
