"""Embeddings, rerank, score, tokenize and the model list, against the models called directly."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from langchain_openai import OpenAIEmbeddings
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from backend_lib.contract import ErrorCode, decode_error
from tests.openai.references import embeddings, rerank_scores
from tooling.checkpoints import MINILM_DIR

pytestmark = pytest.mark.e2e
TEXTS = ["To be, or not to be", "a rose by any other name", "hello world"]
QUERY = "what smells sweet?"
DOCS = ["the rose smells sweet", "a storm at sea", "sweet perfume of flowers", "kings and crowns"]


def test_models_list_and_object(client):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    kinds = {m["id"]: m["kind"] for m in listed["data"]}
    # The llm's LoRA adapter (the default repository ships `sonnets`) is a model of its own;
    # each version is listed under its pinned id too.
    assert kinds == {
        "llm": "llm",
        "sonnets": "llm",
        "embedding": "embedding",
        "rerank": "rerank",
        "llm:1": "llm",
        "embedding:1": "embedding",
        "rerank:1": "rerank",
    }
    llm = client.get("/v1/models/llm").json()
    assert llm["object"] == "model" and llm["id"] == "llm" and llm["max_model_len"] == 1024


def test_embeddings_float_and_base64_equal_the_model(frontend, server):
    sdk = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)
    expected = embeddings(server, TEXTS)
    as_float = sdk.embeddings.create(model="embedding", input=TEXTS, encoding_format="float")
    as_base64 = sdk.embeddings.create(model="embedding", input=TEXTS)  # SDK: base64, decoded
    for result in (as_float, as_base64):
        assert [d.index for d in result.data] == [0, 1, 2]
        np.testing.assert_allclose(
            np.array([d.embedding for d in result.data]), expected, atol=1e-6
        )
    assert as_float.usage.prompt_tokens > len(TEXTS)
    same = sdk.embeddings.create(model="embedding", input=TEXTS[0], dimensions=expected.shape[1])
    np.testing.assert_allclose(same.data[0].embedding, expected[0], atol=1e-6)


MINILM_MAX_SEQ_LENGTH = 256
"""all-MiniLM-L6-v2's sentence-transformers max_seq_length: the default models truncate there."""
LONG = "the rose smells sweet by any other name " * 80  # > 256 tokens


def _truncated(*texts: str) -> list[int]:
    """Each text's tokens as the real tokenizer counts them, truncated to max_seq_length."""
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), local_files_only=True)
    encoded = tokenizer(list(texts), truncation=True, max_length=MINILM_MAX_SEQ_LENGTH)
    return [len(ids) for ids in encoded.input_ids]


def test_encoder_usage_counts_the_tokens_computed_after_truncation(client):
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), local_files_only=True)
    assert len(tokenizer(LONG).input_ids) > MINILM_MAX_SEQ_LENGTH
    reply = client.post("/v1/embeddings", json={"model": "embedding", "input": [LONG, "hello"]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == sum(_truncated(LONG, "hello"))
    # The rerank model (a bi-encoder here) embeds the query and each document on its own.
    body = {"model": "rerank", "query": "hello", "documents": [LONG, "a storm at sea"]}
    query, long_doc, doc = _truncated("hello", LONG, "a storm at sea")
    expected = 2 * query + long_doc + doc
    assert client.post("/v1/rerank", json=body).json()["usage"]["prompt_tokens"] == expected
    body = {"model": "rerank", "text_1": "hello", "text_2": [LONG, "a storm at sea"]}
    assert client.post("/v1/score", json=body).json()["usage"]["prompt_tokens"] == expected


def test_token_id_input_answers_exactly_like_its_text(frontend, server):
    """Token-id items of different lengths (one Triton request per length, ragged-batched) come
    back in input order, with their texts' vectors and token counts."""
    sdk = openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR), local_files_only=True)
    ids = tokenizer(TEXTS).input_ids
    assert len({len(row) for row in ids}) > 1
    from_text = sdk.embeddings.create(model="embedding", input=TEXTS, encoding_format="float")
    from_ids = sdk.embeddings.create(model="embedding", input=ids, encoding_format="float")
    # Equal up to batch composition (another micro-batch shape rounds differently).
    np.testing.assert_allclose(
        np.array([d.embedding for d in from_ids.data]),
        np.array([d.embedding for d in from_text.data]),
        atol=1e-6,
    )
    assert from_ids.usage.prompt_tokens == from_text.usage.prompt_tokens == sum(map(len, ids))
    one = sdk.embeddings.create(model="embedding", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, from_text.data[1].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        sdk.embeddings.create(model="embedding", input=[ids[0], [101, 10**6, 102]])
    with pytest.raises(openai.BadRequestError, match="input"):  # texts and ids mixed
        sdk.embeddings.create(model="embedding", input=["x", [101, 102]])
    with pytest.raises(openai.BadRequestError, match="expected 1..256"):
        sdk.embeddings.create(model="embedding", input=[[1000] * 300])


def test_an_encoder_error_carries_its_code(server):
    """The code survives Triton's unary path too, beside the matching gRPC status."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[LONG.encode()]], dtype=object))
    truncate = grpcclient.InferInput("truncate", [1, 1], "BOOL")
    truncate.set_data_from_numpy(np.array([[False]]))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("embedding", [text, truncate])
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    code, message = decode_error(raised.value.message())
    assert code is ErrorCode.INVALID_INPUT and "truncation is off" in message


def test_langchain_embeddings(frontend, server):
    lc = OpenAIEmbeddings(
        model="embedding",
        base_url=frontend.base_url,
        api_key="unused",
        check_embedding_ctx_length=False,
    )
    np.testing.assert_allclose(lc.embed_documents(TEXTS), embeddings(server, TEXTS), atol=1e-6)
    np.testing.assert_allclose(
        lc.embed_query(TEXTS[1]), embeddings(server, TEXTS[1:2])[0], atol=1e-6
    )


def test_rerank_order_scores_top_n_and_documents(client, server):
    scores = rerank_scores(server, QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: scores[i], reverse=True)
    documents = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = client.post(path, json={"query": QUERY, "documents": documents, "top_n": 2}).json()
        assert [r["index"] for r in reply["results"]] == order[:2]
        for r in reply["results"]:
            assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-6)
            assert r["document"]["text"] == DOCS[r["index"]]
        assert reply["model"] == "rerank:1" and reply["usage"]["prompt_tokens"] > 0
    bare = client.post(
        "/v1/rerank",
        json={"model": "rerank", "query": QUERY, "documents": DOCS, "return_documents": False},
    ).json()
    assert [r["index"] for r in bare["results"]] == order
    assert all("document" not in r for r in bare["results"])
    tei = client.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert [r["index"] for r in tei] == order
    assert [r["text"] for r in tei] == [DOCS[i] for i in order]
    assert tei[0]["score"] == pytest.approx(max(scores), abs=1e-6)


def test_score_one_to_many_and_pairwise(client, server):
    one = client.post("/v1/score", json={"model": "rerank", "text_1": QUERY, "text_2": DOCS}).json()
    assert one["object"] == "list"
    assert [d["score"] for d in one["data"]] == pytest.approx(
        rerank_scores(server, QUERY, DOCS), abs=1e-6
    )
    pairs = client.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    expected = [
        rerank_scores(server, DOCS[0], [DOCS[2]])[0],
        rerank_scores(server, DOCS[1], [DOCS[3]])[0],
    ]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(expected, abs=1e-6)
    assert [d["index"] for d in pairs["data"]] == [0, 1]


def test_tokenize_detokenize_round_trip(client):
    tokens = client.post("/tokenize", json={"model": "llm", "prompt": "ROMEO: hello"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert tokens["tokens"][0] == 1  # <|bos|>
    plain = client.post(
        "/tokenize", json={"model": "llm", "prompt": "ROMEO: hello", "add_special_tokens": False}
    ).json()
    assert plain["tokens"] == tokens["tokens"][1:]
    text = client.post("/detokenize", json={"model": "llm", "tokens": plain["tokens"]}).json()
    assert text == {"prompt": "ROMEO: hello"}
    chat = client.post(
        "/tokenize", json={"model": "llm", "messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > 3


def test_health_ready_and_metrics(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health/ready").status_code == 200
    client.get("/v1/models")
    text = client.get("/metrics").text
    assert 'openai_frontend_requests_total{endpoint="/v1/models",status="200"}' in text
    assert "openai_frontend_request_duration_seconds_bucket" in text
