"""GGUF checkpoints: the default Shakespeare model written as GGUF with the `gguf` package (as
llama.cpp's converter lays it out, tooling/gguf_checkpoints.py) loads with `model: <file>.gguf`,
and greedy tokens equal transformers' on the same file (`gguf_file=`) for F32, F16 and BF16
tensors (and the original checkpoint's for F32) and for Q8_0 and Q4_0 projections, loaded as
stored (W8A16 / W4A16 group 32) with weights bit-identical to `gguf.quants.dequantize`; other
tensor types and a cut-short file are refused at load, naming the tensor and its type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend_lib.config import ConfigError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.engine_helpers import greedy
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.gguf_checkpoints import write_gguf
from tooling.hf_reference import hf_greedy
from tooling.quantized_checkpoints import reference_dequantized_weights

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


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_a_float_gguf_gives_transformers_tokens_on_the_same_file(tensor_type, tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / f"shakespeare-{tensor_type}.gguf", tensor_type)
    engine = engine_on(path)
    try:
        (out,) = engine.generate([PROMPT], greedy(NUM_TOKENS))
    finally:
        engine.close()
    source = {"pretrained_model_name_or_path": tmp_path, "gguf_file": path.name}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    assert out.prompt_token_ids == tokenizer(PROMPT).input_ids
    reference = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    want = hf_greedy(reference, out.prompt_token_ids, NUM_TOKENS)
    assert out.outputs[0].token_ids == want
    if tensor_type == "F32":  # the file holds the checkpoint's own values
        original = AutoModelForCausalLM.from_pretrained(SHAKESPEARE, dtype=torch.float32)
        assert hf_greedy(original, out.prompt_token_ids, NUM_TOKENS) == want
    assert len(list(cache.iterdir())) == 1


def test_a_second_load_reuses_the_converted_checkpoint(tmp_path, cache):
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", "F16")
    engine_on(path).close()
    (converted,) = cache.iterdir()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    engine_on(path).close()
    assert [p.name for p in cache.iterdir()] == [converted.name]
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
def test_q8_0_and_q4_0_load_as_stored_and_dequantize_as_gguf_does(tensor_type, tmp_path, cache):
    """The converted checkpoint is compressed-tensors W8A16 / W4A16 group 32, and its weights as
    compressed-tensors itself decompresses them equal, bit for bit, gguf's dequantization of the
    file (through transformers, which also undoes llama.cpp's rotary row order)."""
    path = write_gguf(SHAKESPEARE, tmp_path / "shakespeare.gguf", tensor_type)
    engine = engine_on(path)
    bits = {"Q8_0": 8, "Q4_0": 4}[tensor_type]
    assert engine.runner.checkpoint.quantization.describe() == (
        f"compressed-tensors pack-quantized W{bits}A16 group 32 symmetric"
    )
    engine.close()
    (converted,) = cache.iterdir()
    ours = reference_dequantized_weights(converted)
    source = {"pretrained_model_name_or_path": tmp_path, "gguf_file": path.name}
    gguf_values = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).state_dict()
    assert len(ours) == 7 * 6  # every projection of the 6 layers
    for name, weight in ours.items():
        assert torch.equal(weight.to(torch.float32), gguf_values[name]), name


@pytest.mark.parametrize(
    ("settings", "tensor"),
    [
        ({"tensor_type": "Q4_1"}, "blk.0.attn_q.weight is Q4_1"),
        ({"embedding_type": "Q8_0"}, "token_embd.weight is Q8_0"),
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
