import json
from pathlib import Path

import pytest

from tooling.repository import (
    DEFAULT_MODELS,
    REPO_ROOT,
    ModelSpec,
    detect_kind,
    read_config,
    render_config,
    render_model_files,
)


def test_committed_default_repository_matches_templates():
    for spec in DEFAULT_MODELS:
        for relative, text in render_model_files(spec).items():
            committed = REPO_ROOT / "model_repository" / relative
            assert committed.read_text() == text, (
                f"{committed} differs from its template: run scripts/render_repository.py"
            )


def test_render_config_parameters_and_policy():
    spec = ModelSpec(
        "m",
        "embedding",
        {"model": "/x", "max_batch_tokens": "512"},
        version_policy="all: {}",
        instance_kind="KIND_CPU",
    )
    text = render_config(spec)
    assert (
        'name: "m"' in text and "kind: KIND_CPU" in text and "version_policy: { all: {} }" in text
    )
    assert 'key: "max_batch_tokens"\n  value: { string_value: "512" }' in text
    # Quotes, backslashes and newlines are escaped: tritonserver's parser reads the value back.
    value = '{"method": "ngram", "a\\b": "c\nd"}'
    config = read_config(render_config(ModelSpec("m", "llm", {"speculative_config": value})))
    assert config["parameters"]["speculative_config"]["string_value"] == value


@pytest.mark.parametrize(
    "architecture,kind",
    [
        ("LlamaForCausalLM", "llm"),
        ("BertForSequenceClassification", "rerank"),
        ("BertModel", "embedding"),
        ("CLIPModel", "embedding"),
        ("SiglipModel", "embedding"),
    ],
)
def test_detect_kind(tmp_path: Path, architecture, kind):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert detect_kind(tmp_path) == kind


def test_decoder_retrieval_checkpoints_get_their_kind(tmp_path: Path):
    """A Qwen3-Embedding style checkpoint (a causal-LM name in config.json, a Pooling module) is
    an embedding model; a decoder `*ForSequenceClassification` or a CrossEncoder-saved causal LM a
    reranker; a bare causal LM an llm."""
    from tests.encoder.encoder_helpers import write_st_files
    from tooling.checkpoints import build_causal_reranker, build_decoder_body

    embedder = build_decoder_body("Qwen3ForCausalLM", tmp_path / "embedder")
    write_st_files(embedder, "lasttoken", normalize=True, max_seq_length=256)
    config = json.loads((embedder / "config.json").read_text())
    (embedder / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]})
    )
    assert detect_kind(embedder) == "embedding"
    reranker = build_decoder_body("Qwen3ForCausalLM", tmp_path / "reranker", num_labels=1)
    assert detect_kind(reranker) == "rerank"
    (embedder / "modules.json").unlink()
    assert detect_kind(embedder) == "llm"
    # A causal-LM reranker saved as a CrossEncoder (Transformer -> LogitScore).
    causal = build_causal_reranker(tmp_path / "causal-reranker")
    assert detect_kind(causal) == "rerank"


def test_a_splade_checkpoint_is_a_sparse_embedding_model(tmp_path: Path):
    """A SparseEncoder save (MLMTransformer -> SpladePooling) is an embedding model rendered with
    the sparse outputs; a bare `*ForMaskedLM` stays refused, as before."""
    from backend_lib.contract import SPARSE_EMBEDDING_OUTPUTS, is_sparse_embedding, model_kind
    from tooling.checkpoints import build_splade
    from tooling.repository import is_sparse_checkpoint

    splade = build_splade(tmp_path / "splade")
    assert detect_kind(splade) == "embedding" and is_sparse_checkpoint(splade)
    (splade / "modules.json").unlink()  # config_sentence_transformers.json's model_type says it
    assert detect_kind(splade) == "embedding" and is_sparse_checkpoint(splade)
    (splade / "config_sentence_transformers.json").unlink()
    assert not is_sparse_checkpoint(splade)
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        detect_kind(splade)
    config = read_config(render_config(ModelSpec("s", "embedding", {"mode": " sparse"})))
    assert model_kind(config) == "embedding" and is_sparse_embedding(config)
    assert tuple(output["name"] for output in config["output"]) == SPARSE_EMBEDDING_OUTPUTS
    inputs = {item["name"] for item in config["input"]}
    assert {
        "text_input",
        "input_ids",
        "truncate",
        "prompt_name",
        "priority",
    } == inputs  # no normalize, dims
    dense = read_config(render_config(ModelSpec("d", "embedding", {"mode": "auto"})))
    assert model_kind(dense) == "embedding" and not is_sparse_embedding(dense)


def test_detect_kind_rejects_unknown(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["WhisperForAudio"]}))
    with pytest.raises(ValueError, match="cannot tell the model kind"):
        detect_kind(tmp_path)
    with pytest.raises(FileNotFoundError):
        detect_kind(tmp_path / "missing")


def test_llm_with_enable_lora_gets_a_multi_lora_json():
    spec = ModelSpec("m", "llm", {"enable_lora": "True"}, lora_modules={"a": "../adapters/a"})
    files = render_model_files(spec)
    assert json.loads(files["m/1/multi_lora.json"]) == {"a": "../adapters/a"}
    # Enabled without adapters: an empty list, so the model still loads.
    assert render_model_files(ModelSpec("m", "llm", {"enable_lora": "true"}))["m/1/multi_lora.json"]
    assert (
        json.loads(
            render_model_files(ModelSpec("m", "llm", {"enable_lora": "1"}))["m/1/multi_lora.json"]
        )
        == {}
    )
    assert "m/1/multi_lora.json" not in render_model_files(ModelSpec("m", "llm", {}))
