"""scripts/add_model.py refuses an LLM checkpoint whose architecture the engine does not serve,
before writing anything, naming the supported ones (the loader's table); it adds a SPLADE
checkpoint in sparse mode, a GGUF file as an llm, an image-text (SigLIP) checkpoint as an
embedding model whose config declares the `image` input, and a vision-language one (Llava,
Gemma 3) as an llm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend_lib.contract import is_sparse_embedding, model_kind
from backend_lib.llm.execution.models import supported_architectures
from tooling.repository import REPO_ROOT, read_config


def _add_model(checkpoint: Path, repository: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "add_model.py"), str(checkpoint)]
        + ["--name", "m", "--repository", str(repository)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )


def test_unsupported_llm_architecture_is_refused_up_front(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["GPT2ForCausalLM"]}))
    repository = tmp_path / "repo"
    result = _add_model(checkpoint, repository)
    assert result.returncode != 0
    assert "unsupported architecture 'GPT2ForCausalLM'" in result.stderr
    for arch in supported_architectures():
        assert arch in result.stderr
    assert not repository.exists()

    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"]}))
    result = _add_model(checkpoint, repository)
    assert result.returncode == 0, result.stderr
    assert (repository / "m" / "config.pbtxt").is_file()


def test_a_splade_checkpoint_is_added_in_sparse_mode(tmp_path):
    checkpoint = tmp_path / "splade"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    modules = [
        {
            "idx": 0,
            "path": "",
            "type": "sentence_transformers.sparse_encoder.models.MLMTransformer",
        },
        {"idx": 1, "path": "1_SpladePooling", "type": "sentence_transformers.models.SpladePooling"},
    ]
    (checkpoint / "modules.json").write_text(json.dumps(modules))
    result = _add_model(checkpoint, tmp_path / "repo")
    assert result.returncode == 0, result.stderr
    config = read_config((tmp_path / "repo" / "m" / "config.pbtxt").read_text())
    assert config["parameters"]["mode"]["string_value"] == "sparse"
    assert is_sparse_embedding(config)


def test_a_gguf_file_is_added_as_an_llm_and_an_unsupported_one_refused(tmp_path):
    from tests.llm.shakespeare_helpers import SHAKESPEARE
    from tooling.gguf_checkpoints import write_gguf

    f16 = write_gguf(SHAKESPEARE, tmp_path / "shakespeare-f16.gguf", "F16")
    result = _add_model(f16, tmp_path / "repo")
    assert result.returncode == 0, result.stderr
    config = read_config((tmp_path / "repo" / "m" / "config.pbtxt").read_text())
    assert config["parameters"]["model"]["string_value"] == str(f16)
    assert config["backend"] == "python" and "text_input" in str(config["input"])
    q2_k = write_gguf(SHAKESPEARE, tmp_path / "shakespeare-q2_k.gguf", "Q2_K")
    result = _add_model(q2_k, tmp_path / "other")
    assert result.returncode != 0
    assert "blk.0.ffn_down.weight is Q2_K" in result.stderr  # the first in the file
    assert not (tmp_path / "other").exists()


def test_a_siglip_checkpoint_is_added_as_an_embedding_model_with_images(tmp_path):
    """(A CLIP one: tests/e2e/test_image_embeddings.py adds and serves it.)"""
    from tooling.vision_checkpoints import build_siglip

    result = _add_model(build_siglip(tmp_path / "siglip"), tmp_path / "repo")
    assert result.returncode == 0, result.stderr
    assert "added embedding model 'm'" in result.stdout
    config = read_config((tmp_path / "repo" / "m" / "config.pbtxt").read_text())
    assert model_kind(config) == "embedding" and not is_sparse_embedding(config)
    inputs = {item["name"]: item for item in config["input"]}
    assert inputs["image"]["data_type"] == "TYPE_STRING" and inputs["image"]["optional"]


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_a_vision_language_checkpoint_is_added_as_an_llm_taking_images(family, tmp_path):
    from tooling.vlm_checkpoints import build_gemma3, build_llava

    build = {"llava": build_llava, "gemma3": build_gemma3}[family]
    result = _add_model(build(tmp_path / family), tmp_path / "repo")
    assert result.returncode == 0, result.stderr
    assert "added llm model 'm'" in result.stdout
    config = read_config((tmp_path / "repo" / "m" / "config.pbtxt").read_text())
    assert model_kind(config) == "llm"
    inputs = {item["name"]: item for item in config["input"]}
    assert inputs["image"]["data_type"] == "TYPE_STRING" and inputs["image"]["optional"]
