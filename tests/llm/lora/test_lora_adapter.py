"""PEFT adapter loading: what is accepted (weights and scaling as PEFT computes them) and every
refusal with its clear error (bad directory, pickle, other base model or shapes, rank over the
limit, unsupported modules or features); the registry's names, errors and host-memory cache."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from backend_lib.config import ConfigError
from backend_lib.errors import InputError
from backend_lib.llm.lora.adapter import LoRALoadError, LoRAModelSpec, load_adapter
from backend_lib.llm.lora.registry import LoRARegistry, read_multi_lora
from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.lora_helpers import lora_checkpoint
from tooling.lora_adapters import build_lora_adapter

SPEC = LoRAModelSpec.for_llama("LlamaForCausalLM", 2, 64, 128, 64, 32)
"""tooling.checkpoints' tiny Llama: 2 layers, hidden 64, MLP 128, 4 heads and 2 kv heads of 16."""


def _adapter(name: str) -> Path:
    return lora_checkpoint("LlamaForCausalLM")[2][name][0]


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(_adapter(name), tmp_path / name))


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | changes))


def test_weights_and_scaling_are_peft_s():
    peft_model = lora_checkpoint("LlamaForCausalLM")[2]["r8-rslora"][1]
    adapter = load_adapter("a", _adapter("r8-rslora"), SPEC, max_lora_rank=16)
    assert len(adapter.modules) == 2 * 7 and adapter.rank == 8
    layer = peft_model.base_model.model.model.layers[1].mlp.down_proj
    module = adapter.modules[(1, "down_proj")]
    assert layer.scaling["default"] == pytest.approx(6 / math.sqrt(8))  # rsLoRA
    assert torch.equal(module.lora_a, layer.lora_A["default"].weight)
    torch.testing.assert_close(
        module.lora_b, layer.lora_B["default"].weight * layer.scaling["default"]
    )


def _error(path: Path, spec: LoRAModelSpec = SPEC, max_rank: int = 16) -> str:
    with pytest.raises(LoRALoadError) as info:
        load_adapter("bad", path, spec, max_rank)
    assert isinstance(info.value, InputError)  # reaches the requesting client only
    assert "LoRA adapter 'bad'" in str(info.value)
    return str(info.value)


def test_rank_over_the_limit_is_refused():
    assert "rank 16 (layer 0 " in _error(_adapter("r16"), max_rank=8)
    assert "exceeds max_lora_rank=8" in _error(_adapter("r16"), max_rank=8)


def test_missing_directory_and_files_are_refused(tmp_path):
    assert "no such directory" in _error(tmp_path / "nowhere")
    assert "no adapter_config.json" in _error(tmp_path)
    path = _copy("r4", tmp_path)
    (path / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in _error(path)


def test_pickle_weights_are_refused(tmp_path):
    path = _copy("r4", tmp_path)
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    assert "pickle files are refused" in _error(path)


def test_another_base_architecture_is_refused(tmp_path):
    _, qwen3 = engine_checkpoint("Qwen3ForCausalLM")
    build_lora_adapter(qwen3, tmp_path / "q3", rank=4, alpha=8)
    assert "trained on a Qwen3ForCausalLM" in _error(tmp_path / "q3")
    _edit_config(tmp_path / "q3", auto_mapping=None)  # then the shapes tell
    assert (
        "lora_A (4, 128) / lora_B (64, 4) do not fit the base model's o_proj (64 -> 64)"
        in _error(tmp_path / "q3")
    )
    assert "the base model has 1 layers" in _error(
        _adapter("r4"), LoRAModelSpec("LlamaForCausalLM", 1, SPEC.shapes)
    )


def test_unsupported_modules_and_features_are_refused(tmp_path):
    _, llama = engine_checkpoint("LlamaForCausalLM")
    build_lora_adapter(llama, tmp_path / "head", rank=4, alpha=8, target_modules=("lm_head",))
    assert "is not a LoRA weight of a supported module" in _error(tmp_path / "head")
    for key, value in [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"])]:
        path = _copy("r4", tmp_path / key)
        _edit_config(path, **{key: value})
        assert f"{key}={value!r} is not supported" in _error(path)
    path = _copy("r4", tmp_path / "prefix")
    _edit_config(path, peft_type="PREFIX_TUNING")
    assert "peft_type must be LORA" in _error(path)


def _registry(tmp_path: Path, capacity: int) -> LoRARegistry:
    modules = {name: _adapter(name) for name in ("r4", "r8-rslora", "r16")}
    modules["broken"] = tmp_path / "missing"
    return LoRARegistry(modules, SPEC, max_lora_rank=16, max_cpu_loras=capacity)


def test_registry_names_ids_and_vllm_errors(tmp_path):
    registry = _registry(tmp_path, 2)
    assert registry.request("r16").lora_int_id == 3
    with pytest.raises(InputError) as info:
        registry.request("nope")
    assert str(info.value) == (
        "LoRA nope is not supported, we currently support ['r4', 'r8-rslora', 'r16', 'broken']"
    )
    with pytest.raises(LoRALoadError, match="no such directory"):
        registry.request("broken")
    assert registry.request("r4").cache_salt != registry.request("r16").cache_salt


def test_registry_keeps_max_cpu_loras_in_host_memory(tmp_path):
    registry = _registry(tmp_path, 2)
    for name in ("r4", "r8-rslora", "r16"):
        registry.request(name)
    assert registry.cached_names() == ["r8-rslora", "r16"] and len(registry.load_seconds) == 3
    held = registry.request("r8-rslora").adapter  # a hit: no load, moves to the back
    assert len(registry.load_seconds) == 3 and registry.cached_names() == ["r16", "r8-rslora"]
    registry.request("r4")  # evicts r16, the least recently requested
    assert registry.cached_names() == ["r8-rslora", "r4"] and len(registry.load_seconds) == 4
    assert registry.request("r8-rslora").adapter is held


def test_multi_lora_json_paths_are_relative_to_the_model_dir(tmp_path):
    version = tmp_path / "1"
    version.mkdir()
    with pytest.raises(ConfigError, match="cannot find .*multi_lora.json"):
        read_multi_lora(version, tmp_path)
    (version / "multi_lora.json").write_text(json.dumps({"a": "../x", "b": "/abs/y"}))
    assert read_multi_lora(version, tmp_path) == {"a": tmp_path / "../x", "b": Path("/abs/y")}
    (version / "multi_lora.json").write_text('["a"]')
    with pytest.raises(ConfigError, match="must map adapter names to paths"):
        read_multi_lora(version, tmp_path)
