"""Pre-quantized test checkpoints: the Shakespeare model written by compressed-tensors itself in
each preset of tooling/quantized_checkpoints.py, built once per process; what the checkpoint-format
tests share (compressed-tensors, GPTQ and AWQ alike): a model loaded as stored and its dequantized
weights, the prompts and greedy comparisons with transformers, editing a copy into a bad
checkpoint that fails the load."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.config import ConfigError
from backend_lib.llm.execution.checkpoint_quantization.layers import StagingLinear
from backend_lib.llm.execution.loader import (
    load_checkpoint_weights,
    load_model,
    read_checkpoint_info,
)
from kernels import kernel_ops
from tests.llm.engine_helpers import greedy, make_engine, random_prompt
from tests.llm.shakespeare_helpers import HELD_OUT, SHAKESPEARE
from tooling import quantized_checkpoints
from tooling.hf_reference import hf_greedy

_BUILT: dict[str, Path] = {}

PACKED_PRESETS = ("W4A16_G128", "W4A16_G64_ASYM", "W4A16_CHANNEL", "W8A16_CHANNEL")
"""Weight-only int presets (pack-quantized), which transformers decompresses and runs on CPU."""
PRESETS = (*PACKED_PRESETS, "W8A8_DYNAMIC", "FP8_DYNAMIC", "FP8_DYNAMIC_PER_TENSOR")

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
)
"""The dense architectures whose tiny random checkpoints (tests/llm/engine_helpers.py) every
checkpoint format is tested on."""


def quantized_shakespeare(preset: str) -> Path:
    """The Shakespeare model quantized by compressed-tensors in `preset` (a tooling preset name)."""
    if preset not in _BUILT:
        out = Path(tempfile.mkdtemp(prefix=f"shakespeare-{preset}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        scheme = quantized_checkpoints.PRESETS[preset]
        _BUILT[preset] = quantized_checkpoints.write_compressed_tensors_checkpoint(
            SHAKESPEARE, out, scheme
        )
    return _BUILT[preset]


def copy_checkpoint(source: Path, dest: Path) -> Path:
    """A writable copy of checkpoint `source` (for corrupting it)."""
    shutil.copytree(source, dest)
    return dest


def staged_model(checkpoint: Path) -> torch.nn.Module:
    """The checkpoint's model on CPU in float32, loaded as stored (its quantized layers still
    `StagingLinear`s)."""
    info = read_checkpoint_info(checkpoint)
    return load_checkpoint_weights(info, torch.device("cpu"), torch.float32, kernel_ops("torch"))


def edit_quantization_config(checkpoint: Path, edit) -> None:
    """Apply `edit` to config.json's `quantization_config` in place."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def edit_tensors(checkpoint: Path, edit) -> None:
    """Apply `edit` to model.safetensors' {name: tensor} and save it back."""
    path = checkpoint / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def staged_weights(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint layer name -> the dequantized weight of `model`'s (a `staged_model`) layer,
    fused projections shard by shard."""
    weights = {}
    for name, module in model.named_modules():
        if not isinstance(module, StagingLinear):
            continue
        param = f"{name}.weight"
        full = module.dequantized(dtype)
        for shard in model.shards_of(param):
            rows = model.shard_view(torch.arange(module.out_features)[:, None], param, shard)
            weights[model.checkpoint_name(param, shard)] = full[rows[:, 0]]
    return weights


def sonnet_prompts(tokenizer_dir: Path) -> list[list[int]]:
    """Two prompts sharing their first 40 tokens (Sonnet 154), tokenized by `tokenizer_dir`'s."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shared = tokenizer(HELD_OUT["Sonnet 154"]).input_ids[:40]
    return [shared + tokenizer(" Love").input_ids, shared + tokenizer(" fire").input_ids]


def assert_greedy_equals_hf_with_chunks_and_a_prefix_hit(
    checkpoint: Path, hf, prompts: list[list[int]]
) -> None:
    """16 greedy tokens of each of `prompts` (`sonnet_prompts`) from the engine on `checkpoint`
    equal `hf`'s, with chunked prefill (16-token steps) and, for the second prompt, a
    prefix-cache hit."""
    expected = [hf_greedy(hf, ids, 16) for ids in prompts]
    engine = make_engine(checkpoint, max_num_batched_tokens=16, max_num_seqs=4)
    first = engine.generate([prompts[0]], greedy(16))[0]
    second = engine.generate([prompts[1]], greedy(16))[0]
    assert second.num_cached_tokens >= 32
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == expected


def assert_greedy_equals_hf_on_random_prompts(checkpoint: Path, hf, arch: str) -> None:
    """8 greedy tokens of two random prompts (5 and 19 tokens) from the engine on `checkpoint`
    (a tiny `arch` checkpoint) equal `hf`'s."""
    engine = make_engine(checkpoint)
    for seed, length in ((1, 5), (2, 19)):
        prompt = random_prompt(length, seed)
        (out,) = engine.generate([prompt], greedy(8))
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8), (arch, seed)


def assert_bad_checkpoint_fails_the_load(
    checkpoint: Path, tmp_path: Path, config_edit, tensors_edit, message: str
) -> None:
    """A copy of `checkpoint` with `config_edit` applied to its quantization_config and
    `tensors_edit` to its tensors (each None: left as is) fails the load matching `message`."""
    copy = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    if config_edit is not None:
        edit_quantization_config(copy, config_edit)
    if tensors_edit is not None:
        edit_tensors(copy, tensors_edit)
    with pytest.raises((ConfigError, ValueError), match=message):
        load_model(copy, torch.device("cpu"), torch.float32, kernel_ops("torch"))
