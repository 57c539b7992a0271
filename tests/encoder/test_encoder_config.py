"""Encoder settings from Triton parameters, checkpoint-file reading, and the fused linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend_lib.config import ConfigError, from_parameters
from backend_lib.encoder.config import EmbeddingConfig, RerankConfig, auto_max_batch_tokens
from backend_lib.encoder.embedder import Embedder
from backend_lib.encoder.reranker import load_reranker
from backend_lib.encoder.st_config import read_cross_encoder_activation
from backend_lib.linear import Linear

CPU = torch.device("cpu")


def test_parameters_fill_the_dataclasses():
    config = from_parameters(
        EmbeddingConfig,
        {
            "model": "/m",
            "dtype": "bfloat16",
            "max_batch_tokens": "4096",
            "normalize": "false",
            "truncate": "no",
        },
    )
    assert (
        config.model,
        config.dtype,
        config.max_batch_tokens,
        config.normalize,
        config.truncate,
    ) == (
        "/m",
        "bfloat16",
        4096,
        False,
        False,
    )
    assert from_parameters(EmbeddingConfig, {}).normalize is None
    rerank = from_parameters(RerankConfig, {"mode": "cross_encoder", "apply_sigmoid": "true"})
    assert (rerank.mode, rerank.apply_sigmoid) == ("cross_encoder", True)


@pytest.mark.parametrize(
    "cls,params,key",
    [
        (EmbeddingConfig, {"max_batch_tokens": "-1"}, "max_batch_tokens"),
        (EmbeddingConfig, {"max_batch_size": "-1"}, "max_batch_size"),
        (EmbeddingConfig, {"max_seq_length": "-5"}, "max_seq_length"),
        (EmbeddingConfig, {"max_seq_length": "512", "max_batch_tokens": "256"}, "max_seq_length"),
        (EmbeddingConfig, {"max_text_bytes": "10"}, "max_text_bytes"),
        (EmbeddingConfig, {"max_image_bytes": "100"}, "max_image_bytes"),
        (EmbeddingConfig, {"max_image_pixels": "0"}, "max_image_pixels"),
        (RerankConfig, {"max_image_bytes": "4096"}, "max_image_bytes"),  # embedding-only
        (EmbeddingConfig, {"dtype": "int8"}, "dtype"),
        (EmbeddingConfig, {"model": " "}, "model"),
        (RerankConfig, {"mode": "colbert"}, "mode"),
        (RerankConfig, {"normalize": "true"}, "normalize"),  # an embedding-only key
    ],
)
def test_bad_parameters_name_key_and_value(cls, params, key):
    with pytest.raises(ConfigError) as info:
        from_parameters(cls, params)
    assert info.value.key == key


def test_limits_checked_against_the_checkpoint(enc):
    with pytest.raises(ConfigError, match="position embeddings hold at most 512") as info:
        Embedder.from_config(EmbeddingConfig(max_seq_length=1000), CPU, Path("."))
    assert info.value.key == "max_seq_length"
    with pytest.raises(ConfigError) as info:
        Embedder.from_config(EmbeddingConfig(max_batch_tokens=100), CPU, Path("."))
    assert info.value.key == "max_batch_tokens"
    assert (
        Embedder.from_config(EmbeddingConfig(max_seq_length=32), CPU, Path(".")).max_seq_length
        == 32
    )


def test_auto_batch_tokens_by_device_and_item_length(enc):
    # 0 (the default) settles at load: CPU 4096, GPUs 16384, never under one item's length.
    assert EmbeddingConfig().max_batch_tokens == 0
    config = EmbeddingConfig()
    assert Embedder.from_config(config, CPU, Path(".")).max_batch_tokens == 4096
    assert config.max_batch_tokens == 4096
    assert auto_max_batch_tokens("cuda", 512) == 16384
    assert auto_max_batch_tokens("cpu", 8192) == 8192
    rerank = RerankConfig()
    assert load_reranker(rerank, CPU, Path(".")) is not None
    assert rerank.max_batch_tokens == 4096
    explicit = EmbeddingConfig(max_batch_tokens=300)
    assert Embedder.from_config(explicit, CPU, Path(".")).max_batch_tokens == 300


def test_unsupported_sentence_transformers_module_is_refused(tiny_bert_dir, tmp_path, enc):
    for item in tiny_bert_dir.iterdir():
        (tmp_path / item.name).symlink_to(item)
    enc.write_json(
        tmp_path / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Dense",
                "type": "sentence_transformers.models.Dense",
            },
        ],
    )
    with pytest.raises(ConfigError, match="unsupported sentence-transformers modules"):
        Embedder.from_config(EmbeddingConfig(model=str(tmp_path)), CPU, Path("."))


ST_CONFIG = "config_sentence_transformers.json"
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"}
]
SIGMOID, IDENTITY, TANH = (
    "torch.nn.modules.activation.Sigmoid",
    "torch.nn.modules.linear.Identity",
    "torch.nn.modules.activation.Tanh",
)


@pytest.mark.parametrize(
    "config_section,legacy,st_file,expected",
    [
        (None, None, None, "sigmoid"),  # one label, nothing saved
        ({"activation_fn": IDENTITY}, None, None, "identity"),
        (None, TANH, None, "tanh"),  # pre-v4 key
        ({"activation_fn": IDENTITY}, None, SIGMOID, "sigmoid"),  # saved CrossEncoder wins
        ({"activation_fn": "my_pkg.Custom"}, None, None, "sigmoid"),  # untrusted path ignored
    ],
)
def test_cross_encoder_activation_as_sentence_transformers_resolves_it(
    tmp_path, enc, config_section, legacy, st_file, expected
):
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    config = enc.tiny_bert_config(num_labels=1, num_hidden_layers=1)
    if config_section:
        config.sentence_transformers = config_section
    if legacy:
        config.sbert_ce_default_activation_function = legacy
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    enc.copy_minilm_tokenizer(tmp_path)
    if st_file:
        enc.write_json(tmp_path / "modules.json", MODULES)
        enc.write_json(
            tmp_path / ST_CONFIG, {"model_type": "CrossEncoder", "activation_fn": st_file}
        )
    ours = read_cross_encoder_activation(tmp_path, str(tmp_path), num_labels=1)
    reference = CrossEncoder(str(tmp_path), device="cpu", local_files_only=True).activation_fn
    assert ours == expected == type(reference).__name__.lower()


@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh", "relu", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_matches_torch(activation, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40, dtype=dtype), torch.randn(48, dtype=dtype)
    x, residual = torch.randn(37, 40, dtype=dtype), torch.randn(37, 48, dtype=dtype)
    eager = {
        "none": lambda y: y,
        "gelu": F.gelu,
        "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
        "relu": F.relu,
        "tanh": torch.tanh,
    }[activation]
    plain = F.linear(x.float(), weight.float(), bias.float())
    layer = Linear(weight, bias, activation)
    # oneDNN on CPU for float32, and for bfloat16 where the CPU has native bf16 support (AVX512-BF16,
    # AMX); float16, and bfloat16 on other CPUs, take the F.linear path.
    onednn_dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        onednn_dtypes.add(torch.bfloat16)
    assert layer.uses_onednn == (torch.backends.mkldnn.is_available() and dtype in onednn_dtypes)
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(layer(x).float(), eager(plain), atol=tolerance, rtol=tolerance)
    if activation == "none":
        torch.testing.assert_close(
            layer(x, residual=residual).float(),
            plain + residual.float(),
            atol=tolerance,
            rtol=tolerance,
        )
    else:
        with pytest.raises(ValueError):
            layer(x, residual=residual)


@pytest.mark.parametrize("epilogue", [True, False], ids=["gelu_in_epilogue", "gelu_after_gemm"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_packed_linear_gelu_either_way_matches_torch(monkeypatch, activation, epilogue):
    """Both GELU placements of the packed GEMM (in oneDNN's epilogue on AVX-512 CPUs, after the
    GEMM elsewhere) give torch's GELU of the float32 linear."""
    import backend_lib.linear as linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: the F.linear path is tested above")
    monkeypatch.setattr(linear, "_gelu_epilogue_pays", lambda: epilogue)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(53, 40)
    layer = Linear(weight, bias, activation)
    assert layer.uses_onednn and (layer._after_gemm is None) == epilogue
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    expected = F.gelu(F.linear(x, weight, bias), approximate=approximate)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_small_m_gemv_matches_the_gemm(activation, dtype):
    """A call of up to `gemv_max_rows` rows runs the blocked GEMV over the packed weight's own bytes
    (kernels/gemv.py) where it can: the same results as oneDNN's GEMM, its residual add and
    activation included; more rows, and `gemv_max_rows` 0, take the GEMM."""
    torch.manual_seed(0)
    weight, bias = torch.randn(100, 70, dtype=dtype), torch.randn(100, dtype=dtype)
    layer = Linear(weight, bias, activation)
    if not layer.uses_onednn:
        pytest.skip(f"oneDNN does not pack {dtype} here")
    assert layer.uses_gemv == (layer._blocked is not None) and layer.gemv_max_rows > 0
    gemm = Linear(weight, bias, activation)
    gemm.gemv_max_rows = 0
    assert not gemm.uses_gemv
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    for rows in {1, layer.gemv_max_rows, layer.gemv_max_rows + 1}:
        x, residual = torch.randn(rows, 70, dtype=dtype), torch.randn(rows, 100, dtype=dtype)
        torch.testing.assert_close(layer(x), gemm(x), atol=tolerance, rtol=tolerance)
        if activation == "none":
            got = layer(x, residual=residual)
            torch.testing.assert_close(
                got, gemm(x, residual=residual), atol=tolerance, rtol=tolerance
            )
