"""End to end: a SPLADE checkpoint added by scripts/add_model.py (an embedding model in sparse mode)
served beside the default llm, embedding and rerank models by one real tritonserver, called
through the frontend's TEI `/embed_sparse` and on Triton itself (`indices`, `values`), against
sentence-transformers' SparseEncoder; bad input gets a clear error, and each endpoint refuses the
other kind of embedding model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backend_lib import contract
from tests.encoder.sparse_helpers import (
    MAX_SEQ_LENGTH,
    PROMPTS,
    assert_same_vectors,
    reference_vectors,
)
from tests.openai.frontend_helpers import Frontend, served_with_server
from tooling.checkpoints import build_splade
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e
REPO_ROOT = Path(__file__).resolve().parents[2]
LONG = "the quick brown fox jumps over the lazy dog " * 10  # over max_seq_length: cut
TEXTS = ["what smells sweet?", "the rose smells sweet", "x", LONG, "Ünïcödé: café, 東京タワー"]


@dataclass
class Served:
    splade: Path
    server: TritonServer
    front: Frontend
    client: httpx.Client
    triton: httpclient.InferenceServerClient


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("sparse-embedding")
    splade = build_splade(root / "splade", max_seq_length=MAX_SEQ_LENGTH, prompts=PROMPTS)
    # The default repository as it is (its models found at ../../models), plus the SPLADE one.
    repository = root / "serving" / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository)
    (root / "serving" / "models").symlink_to(REPO_ROOT / "models")
    added = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "add_model.py"), str(splade)]
        + ["--name", "splade", "--repository", str(repository), "--param", "dtype=float32"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert added.returncode == 0, added.stderr
    with (
        served_with_server(repository) as (server, front),
        httpx.Client(base_url=front.url, timeout=120) as client,
    ):
        # Closed before the server stops: it waits for open connections when it exits.
        triton = httpclient.InferenceServerClient(server.http_url, concurrency=4)
        try:
            yield Served(splade, server, front, client, triton)
        finally:
            triton.close()


def _post(served: Served, path: str, body: dict) -> httpx.Response:
    return served.client.post(path, json=body)


def _tei_rows(reply: httpx.Response) -> tuple[list[np.ndarray], list[np.ndarray]]:
    assert reply.status_code == 200, reply.text
    rows = reply.json()
    ids = [np.array([e["index"] for e in row], dtype=np.int64) for row in rows]
    weights = [np.array([e["value"] for e in row], dtype=np.float32) for row in rows]
    return ids, weights


def test_embed_sparse_matches_sparse_encoder(served):
    # No `model`: the one sparse embedding model, though a dense one is served too.
    ids, weights = _tei_rows(_post(served, "/embed_sparse", {"inputs": TEXTS}))
    assert_same_vectors(ids, weights, reference_vectors(served.splade, TEXTS))
    body = {"inputs": TEXTS, "prompt_name": "query", "model": "splade", "truncate": True}
    ids, weights = _tei_rows(_post(served, "/embed_sparse", body))
    assert_same_vectors(ids, weights, reference_vectors(served.splade, TEXTS, prompt_name="query"))


def _triton_request(texts: list[str], **inputs: np.ndarray) -> dict:
    """The arguments of a Triton call of the SPLADE model on `texts`, with more `inputs`."""
    tensors = []
    for name, array in {
        contract.TEXT_INPUT: np.array([[t.encode()] for t in texts], dtype=object),
        **inputs,
    }.items():
        datatype = "BYTES" if array.dtype == object else "BOOL"
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    outputs = [httpclient.InferRequestedOutput(n) for n in contract.SPARSE_EMBEDDING_OUTPUTS]
    return {"model_name": "splade", "inputs": tensors, "outputs": outputs}


def _assert_triton_rows(result, reference: np.ndarray) -> None:
    """A Triton result's `indices` / `values`: padded with -1 and 0 to the longest row, and,
    the padding dropped, the reference's vectors."""
    indices, values = result.as_numpy(contract.INDICES), result.as_numpy(contract.VALUES)
    assert indices.dtype == np.int64 and values.dtype == np.float32
    assert indices.shape == values.shape and indices.shape[0] == len(reference)
    kept = indices != contract.SPARSE_PAD_INDEX
    assert kept.sum(axis=1).max() == indices.shape[1] and (values[~kept] == 0).all()
    assert_same_vectors(
        [row[k] for row, k in zip(indices, kept, strict=True)],
        [row[k] for row, k in zip(values, kept, strict=True)],
        reference,
    )


def test_triton_outputs_padded_indices_and_values(served):
    assert contract.is_sparse_embedding(served.triton.get_model_config("splade"))
    result = served.triton.infer(**_triton_request(TEXTS))
    _assert_triton_rows(result, reference_vectors(served.splade, TEXTS))
    assert result.as_numpy(contract.NUM_INPUT_TOKENS)[3, 0] == MAX_SEQ_LENGTH


def test_bad_input_fails_alone_with_a_clear_error(served):
    refused = _post(served, "/embed_sparse", {"inputs": [LONG], "truncate": False})
    assert refused.status_code == 400
    assert f"over the limit of {MAX_SEQ_LENGTH}" in refused.json()["error"]["message"]
    unknown = _post(served, "/embed_sparse", {"inputs": ["x"], "prompt_name": "passage"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "prompt_name"
    assert "'document', 'query'" in unknown.json()["error"]["message"]
    # Sent together, so Triton's dynamic batcher may give them to one execute: the good ones
    # are answered either way.
    bad, good = ([LONG], {"truncate": np.array([[False]])}), (TEXTS, {})
    calls = [
        served.triton.async_infer(**_triton_request(texts, **inputs))
        for texts, inputs in (bad, good, bad, good)
    ]
    expected = reference_vectors(served.splade, TEXTS)
    for i, call in enumerate(calls):
        if i % 2 == 0:
            with pytest.raises(InferenceServerException, match="truncation is off"):
                call.get_result()
        else:
            _assert_triton_rows(call.get_result(), expected)


def test_each_endpoint_refuses_the_other_kind_and_the_defaults_still_serve(served):
    for path, body, hint in [
        ("/embed_sparse", {"inputs": ["a"], "model": "embedding"}, "/v1/embeddings or /embed"),
        ("/embed", {"inputs": ["a"], "model": "splade"}, "/embed_sparse"),
        ("/v1/embeddings", {"input": ["a"], "model": "splade"}, "/embed_sparse"),
    ]:
        reply = _post(served, path, body)
        assert reply.status_code == 400 and hint in reply.json()["error"]["message"], reply.text
    listed = {m["id"] for m in served.client.get("/v1/models").json()["data"]}
    assert {"llm", "embedding", "rerank", "splade"} <= listed
    # Without `model`, /v1/embeddings still reaches the one dense embedding model.
    dense = _post(served, "/v1/embeddings", {"input": ["hello"]})
    assert dense.status_code == 200 and len(dense.json()["data"][0]["embedding"]) == 384
    rerank = _post(served, "/v1/rerank", {"model": "rerank", "query": "q", "documents": ["a"]})
    assert rerank.status_code == 200, rerank.text
    chat = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert _post(served, "/v1/chat/completions", chat).status_code == 200
