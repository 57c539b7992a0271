"""The frontend recomputes nothing the backend decides: an llm's max_model_len and LoRA adapters
are what its version published (answering `describe`), prompts are not tokenized to fill a
`max_tokens` default, encoder usage is the tokens the model reports, and a model's error maps to
its HTTP status by the code it carries. Against stand-ins for tritonserver (no server)."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import InferenceServerException

from backend_lib import contract
from backend_lib.errors import InputError, QueueFullError, RequestCancelled, response_error
from backend_lib.llm.core.sampling_params import SamplingParams
from openai_frontend.app import create_app
from openai_frontend.config import FrontendConfig
from openai_frontend.errors import APIError, from_triton_exception
from openai_frontend.tokenization import ModelTokenizer
from openai_frontend.triton import LLMResponse, TritonClient
from tests.openai.fake_triton_helpers import FakeTriton, fake_app, llm_spec
from tooling.checkpoints import MINILM_DIR
from tooling.repository import REPO_ROOT, ModelSpec, write_model

SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"


@pytest.fixture(params=["on", "true"])
def repository(tmp_path: Path, request) -> Path:
    """An llm with LoRA enabled (spelled `on` or `true`), whose multi_lora.json is not valid JSON
    (the engine read the listing at load; the frontend must not read it again), and an embedding
    and a rerank."""
    write_model(llm_spec(enable_lora=request.param, max_model_len="0"), tmp_path)
    (tmp_path / "llm" / "1" / "multi_lora.json").write_text("{not json")
    for kind in ("embedding", "rerank"):
        write_model(ModelSpec(kind, kind, {"model": str(MINILM_DIR)}), tmp_path)
    return tmp_path


def _models(client: TestClient) -> dict[str, dict[str, Any]]:
    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {model["id"]: model for model in response.json()["data"]}


def test_models_show_the_published_max_model_len_and_adapters(repository):
    facts = {("llm", "1"): contract.ModelFacts(max_model_len=777, lora_adapters=("sonnets",))}
    fake = FakeTriton(
        [
            llm_spec(enable_lora="on"),
            ModelSpec("embedding", "embedding", {"model": str(MINILM_DIR)}),
        ],
        facts,
    )
    with fake_app(repository, fake) as client:
        models = _models(client)
        assert models["sonnets"]["parent"] == "llm"  # not read from multi_lora.json
        assert models["llm"]["max_model_len"] == 777  # not the checkpoint's 1024
        assert models["sonnets"]["max_model_len"] == 777
        assert client.get("/v1/models/llm:sonnets").json()["parent"] == "llm"
        assert models["embedding"]["max_model_len"] is None
        tokens = client.post("/tokenize", json={"model": "llm", "prompt": "ROMEO:"}).json()
        assert tokens["max_model_len"] == 777
    assert fake.facts_asked == [("llm", "1")]  # once, then cached; only llms publish facts


def test_no_adapters_when_the_engine_serves_none(repository):
    # multi_lora.json on disk lists nothing readable; enable_lora "on": the engine is the judge.
    fake = FakeTriton([llm_spec(enable_lora="on")], {("llm", "1"): contract.ModelFacts(1024, ())})
    with fake_app(repository, fake) as client:
        assert set(_models(client)) == {"llm", "llm:1"}  # the newest, and each version pinned


def test_facts_are_per_version_and_asked_again_after_a_reload(tmp_path):
    write_model(llm_spec(versions=(1, 2)), tmp_path)
    facts = {("llm", "1"): contract.ModelFacts(1024), ("llm", "2"): contract.ModelFacts(2048)}
    fake = FakeTriton([llm_spec(versions=(1, 2))], facts)
    registry_ttl = {"index_ttl_s": 0.0}
    app = create_app(
        FrontendConfig(triton_url="127.0.0.1:1", model_repository=tmp_path, **registry_ttl)
    )
    app.state.frontend.triton = app.state.frontend.registry.triton = fake
    with TestClient(app) as client:
        assert _models(client)["llm"]["max_model_len"] == 2048  # the served (latest) version
        assert _models(client)["llm"]["version"] == "2"
        fake.ready.discard(("llm", "2"))  # version 2 unloaded: version 1 is served
        assert _models(client)["llm"]["max_model_len"] == 1024
        fake.ready.add(("llm", "2"))  # reloaded: it may publish something else now
        fake.facts[("llm", "2")] = contract.ModelFacts(512)
        assert _models(client)["llm"]["max_model_len"] == 512
    assert fake.facts_asked.count(("llm", "2")) == 2


def test_a_model_that_does_not_publish_facts_has_none(tmp_path):
    """An llm whose config lacks `describe` (e.g. Triton's vLLM backend) is served without
    limits or adapters, and never asked."""
    spec = llm_spec()
    write_model(spec, tmp_path)

    class Undescribed(FakeTriton):
        async def model_config(self, name, version=""):
            config = await super().model_config(name, version)
            config["input"] = [i for i in config["input"] if i["name"] != contract.DESCRIBE]
            return config

    fake = Undescribed([spec], {})
    with fake_app(tmp_path, fake) as client:
        assert _models(client)["llm"]["max_model_len"] is None
    assert fake.facts_asked == []


@pytest.fixture
def no_tokenizing(monkeypatch):
    """The frontend's tokenizer may render a chat prompt, never encode one."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the frontend tokenized a prompt")

    monkeypatch.setattr(ModelTokenizer, "encode", refuse)


def test_completions_and_chat_never_tokenize_the_prompt(repository, no_tokenizing):
    fake = FakeTriton([llm_spec()], {("llm", "1"): contract.ModelFacts(1024)})
    with fake_app(repository, fake) as client:
        reply = client.post("/v1/completions", json={"model": "llm", "prompt": ["a", "b"]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"] == {
            "prompt_tokens": 14,  # the backend's num_input_tokens, 7 per prompt
            "completion_tokens": 2,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        messages = [{"role": "user", "content": "Who goes there?"}]
        chat = client.post("/v1/chat/completions", json={"model": "llm", "messages": messages})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == 7
        capped = client.post(
            "/v1/completions", json={"model": "llm", "prompt": "a", "max_tokens": 5}
        )
        assert capped.status_code == 200, capped.text
    # No default computed here: `max_tokens: null` is sent, and the engine generates up to its
    # own max_model_len (left out, SamplingParams' default of 16 would apply).
    assert [p["max_tokens"] for p in fake.generated] == [None, None, None, 5]
    assert SamplingParams.from_dict(fake.generated[0]).max_tokens is None
    assert SamplingParams.from_dict({}).max_tokens == 16


def test_encoder_usage_is_what_the_model_reports(repository):
    fake = FakeTriton(
        [
            ModelSpec("embedding", "embedding", {"model": str(MINILM_DIR)}),
            ModelSpec("rerank", "rerank", {"model": str(MINILM_DIR)}),
        ],
        {},
    )
    fake.tokens_per_row = 5
    with fake_app(repository, fake) as client:
        texts = ["a long text " * 300, "short"]
        reply = client.post("/v1/embeddings", json={"model": "embedding", "input": texts})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
        body = {"model": "rerank", "query": "q", "documents": ["a", "b", "c"]}
        assert client.post("/v1/rerank", json=body).json()["usage"]["prompt_tokens"] == 15
        body = {"model": "rerank", "text_1": "q", "text_2": ["a", "b"]}
        assert client.post("/v1/score", json=body).json()["usage"]["prompt_tokens"] == 10


# --- errors: each code to its HTTP status, by code only --------------------------------------


class Boom(Exception):
    """An internal failure whose type name does not end in Error."""


ERRORS = [
    (InputError("max_tokens must be <= max_model_len (1024), got 5000"), 400),
    (InputError("ValueError: the prompt quotes a traceback"), 400),
    (InputError("request r was cancelled by its author (the prompt says so)"), 400),
    (QueueFullError("queue full: 2 requests waiting (max_queue_size=1)"), 429),
    (RequestCancelled("request r was cancelled"), 503),
    (RuntimeError("generation failed: injected fault"), 500),
    (Boom("invalid input, says the text"), 500),
]


class _Stream:
    """What tritonclient's aio `stream_infer` returns: (result, error) pairs."""

    def __init__(self, pairs):
        self._pairs = iter(pairs)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._pairs)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self):
        self.cancelled = True


class _GrpcClient:
    def __init__(self, pairs):
        self.pairs, self.requests = pairs, []

    def stream_infer(self, inputs_iterator, stream_timeout=None):
        self.stream = _Stream(self.pairs)
        self.requests.append(inputs_iterator)
        return self.stream

    async def close(self):
        pass


def _triton(pairs) -> tuple[TritonClient, _GrpcClient]:
    triton = TritonClient("127.0.0.1:1")
    grpc_client = _GrpcClient(pairs)
    triton._client = grpc_client
    return triton, grpc_client


async def _generate(triton: TritonClient) -> list[LLMResponse]:
    return [r async for r in triton.generate("llm", "hi", {}, stream=True)]


@pytest.mark.parametrize("exc,status", ERRORS, ids=lambda v: type(v).__name__)
def test_a_streamed_model_error_maps_to_its_status_by_code(exc, status):
    _, message = response_error(exc)  # what model.py sends; a stream delivers the message only
    triton, _ = _triton([(None, InferenceServerException(msg=message))])
    with pytest.raises(APIError) as raised:
        asyncio.run(_generate(triton))
    error = raised.value
    assert error.status == status
    assert error.message == contract.decode_error(message)[1] and str(exc) in error.message
    assert ("Retry-After" in error.headers) is (status == 429)


@pytest.mark.parametrize("exc,status", ERRORS, ids=lambda v: type(v).__name__)
def test_an_inference_error_maps_to_its_status_by_code(exc, status):
    code, message = response_error(exc)
    grpc_status = {"INVALID_ARG": "INVALID_ARGUMENT"}.get(code, code)
    error = from_triton_exception(
        InferenceServerException(msg=message, status=f"StatusCode.{grpc_status}")
    )
    assert error.status == status


@pytest.mark.parametrize(
    "status,expected",
    [
        ("StatusCode.INVALID_ARGUMENT", 400),
        ("StatusCode.NOT_FOUND", 404),
        ("StatusCode.UNAVAILABLE", 503),
        ("StatusCode.INTERNAL", 500),
        (None, 500),
    ],
)
def test_tritons_own_errors_map_by_grpc_status(status, expected):
    exc = InferenceServerException(msg="unexpected inference input 'colour'", status=status)
    assert from_triton_exception(exc).status == expected


def test_an_uncoded_stream_error_is_internal():
    triton, _ = _triton([(None, InferenceServerException(msg="Stub process is not healthy"))])
    with pytest.raises(APIError) as raised:
        asyncio.run(_generate(triton))
    assert raised.value.status == 500


def _facts_result(payload: bytes) -> InferResult:
    response = service_pb2.ModelInferResponse()
    output = response.outputs.add()
    output.name, output.datatype = contract.MODEL_FACTS, "BYTES"
    output.shape.extend([1])
    response.raw_output_contents.append(struct.pack("<I", len(payload)) + payload)
    response.parameters["triton_final_response"].bool_param = True
    return InferResult(response)


def test_the_client_asks_a_version_for_its_facts():
    facts = contract.ModelFacts(2048, ("sonnets",))
    triton, grpc_client = _triton([(_facts_result(facts.to_json().encode()), None)])
    assert asyncio.run(triton.model_facts("llm", "2")) == facts
    assert not grpc_client.stream.cancelled  # the final response ended the stream

    async def first_request():
        return await anext(grpc_client.requests[0])

    request = asyncio.run(first_request())
    assert (request["model_name"], request["model_version"]) == ("llm", "2")
    names = [tensor.name() for tensor in request["inputs"]]
    assert names == [contract.TEXT_INPUT, contract.DESCRIBE]


def test_malformed_facts_are_an_error():
    triton, _ = _triton([(_facts_result(b'{"max_model_len": "long"}'), None)])
    with pytest.raises(APIError) as raised:
        asyncio.run(triton.model_facts("llm", "1"))
    assert raised.value.status == 500 and "facts" in raised.value.message


def test_the_llm_answers_describe_with_its_facts_json():
    """The backend side of `describe`, without an engine: LLMService.start sends the facts."""
    from backend_lib.llm.config import LLMConfig
    from backend_lib.llm.serving.service import LLMService

    class Registry:
        names = ["b", "a"]

    class Inputs:
        images = None  # a text model

    class Engine:
        max_model_len = 2048
        lora_registry = Registry()
        config = LLMConfig(tool_call_parser="hermes")
        inputs = Inputs()

    service = LLMService.__new__(LLMService)
    service.engine, service.metrics = Engine(), None
    sent = []
    inputs = {
        contract.TEXT_INPUT: np.array([b""], dtype=object),
        contract.DESCRIBE: np.array([True]),
    }
    assert service.start(inputs, lambda result, final: sent.append((result, final)), bool) is None
    ((tensors, final),) = sent
    assert final and set(tensors) == {contract.MODEL_FACTS}
    assert json.loads(tensors[contract.MODEL_FACTS][0]) == {
        "max_model_len": 2048,
        "lora_adapters": ["b", "a"],
        "tool_call_parser": "hermes",
        "reasoning_parser": None,
        "max_images": 0,
        "max_image_bytes": 0,
    }
    Engine.lora_registry = None  # LoRA off: no adapters
    sent.clear()
    service.start(inputs, lambda result, final: sent.append((result, final)), bool)
    assert contract.ModelFacts.from_json(sent[0][0][contract.MODEL_FACTS][0]).lora_adapters == ()
