"""A table of malformed requests to the llm, embedding and rerank models over HTTP and gRPC, each with a
distinctive substring its error message must hold (naming the problem), and `send` to play one case.

Messages come from two places: Triton itself (datatype, shape, batch size, missing inputs, unknown
model or version, unparsable JSON body) and backend_lib (values: UTF-8, JSON, numeric ranges, limits).
Expected substrings assume the llm deployment of the default repository (max_model_len 1024,
max_prompt_bytes 1 MiB, max_n 16, max_logprobs 20, vocabulary 4096) and the encoders' batch limit 64.
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

TIMEOUT = 180.0
Tensor = tuple[str, np.ndarray, str]


@dataclass
class Generate:
    """POST /v2/models/<model>[/versions/<v>]/generate (or generate_stream): a JSON body, or raw bytes."""

    body: dict | bytes
    stream: bool = False
    version: str = ""


@dataclass
class Infer:
    """A KServe inference call with these tensors (a gRPC stream for the decoupled llm over gRPC,
    unless `unary`)."""

    tensors: tuple[Tensor, ...]
    version: str = ""
    unary: bool = False


@dataclass
class MalformedCase:
    id: str
    protocol: Literal["http", "grpc"]
    model: str
    request: Generate | Infer
    expected: str
    """A substring of the error message that names the problem."""


def strings(*values: str | bytes) -> np.ndarray:
    """A BYTES tensor of shape [N] (llm inputs)."""
    return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=object)


def rows(*values: str | bytes) -> np.ndarray:
    """A BYTES tensor of shape [N, 1] (encoder inputs: batch dimension first)."""
    return strings(*values).reshape(-1, 1)


def scalar(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


PROMPT = ("text_input", strings("ROMEO:"), "BYTES")
STREAM = ("stream", scalar(True, bool), "BOOL")


def sampling(params: str) -> Generate:
    """A /generate body whose `sampling_parameters` is this JSON text."""
    return Generate({"text_input": "ROMEO:", "sampling_parameters": params})


def llm_stream(*tensors: Tensor) -> Infer:
    return Infer((PROMPT, STREAM, *tensors))


CASES: list[MalformedCase] = [
    # --- llm over HTTP /generate: sampling_parameters JSON --------------------------------------
    MalformedCase(
        "llm-http-sp-invalid-json", "http", "llm", sampling("{not json"), "not valid JSON"
    ),
    MalformedCase(
        "llm-http-sp-not-object",
        "http",
        "llm",
        sampling("[1, 2]"),
        "must be a JSON object, got list",
    ),
    MalformedCase(
        "llm-http-sp-unknown-field",
        "http",
        "llm",
        sampling('{"colour": "red"}'),
        "unknown sampling parameter 'colour'",
    ),
    MalformedCase(
        "llm-http-sp-nan-temperature",
        "http",
        "llm",
        sampling('{"temperature": NaN}'),
        "temperature must be finite, got nan",
    ),
    MalformedCase(
        "llm-http-sp-inf-top-p",
        "http",
        "llm",
        sampling('{"top_p": Infinity}'),
        "top_p must be finite, got inf",
    ),
    MalformedCase(
        "llm-http-sp-neg-inf-penalty",
        "http",
        "llm",
        sampling('{"presence_penalty": -Infinity}'),
        "presence_penalty must be finite",
    ),
    MalformedCase(
        "llm-http-sp-zero-max-tokens",
        "http",
        "llm",
        sampling('{"max_tokens": 0}'),
        "max_tokens must be >= 1, got 0",
    ),
    MalformedCase(
        "llm-http-sp-huge-max-tokens",
        "http",
        "llm",
        sampling('{"max_tokens": 1000000000000}'),
        "max_tokens must be <= max_model_len (1024)",
    ),
    MalformedCase(
        "llm-http-sp-huge-seed",
        "http",
        "llm",
        sampling(f'{{"seed": {2**70}}}'),
        "seed must be in [",
    ),
    MalformedCase(
        "llm-http-sp-negative-top-k",
        "http",
        "llm",
        sampling('{"top_k": -7}'),
        "top_k must be -1 or 0 (disabled) or >= 1, got -7",
    ),
    MalformedCase(
        "llm-http-sp-huge-n",
        "http",
        "llm",
        sampling('{"n": 1000, "temperature": 1}'),
        "n must be <= 16, got 1000",
    ),
    MalformedCase(
        "llm-http-sp-huge-logprobs",
        "http",
        "llm",
        sampling('{"logprobs": 1000}'),
        "logprobs must be <= 20, got 1000",
    ),
    MalformedCase(
        "llm-http-sp-zero-repetition-penalty",
        "http",
        "llm",
        sampling('{"repetition_penalty": 0}'),
        "repetition_penalty must be > 0",
    ),
    MalformedCase(
        "llm-http-sp-min-over-max-tokens",
        "http",
        "llm",
        sampling('{"min_tokens": 10, "max_tokens": 5}'),
        "min_tokens must be <= max_tokens (5), got 10",
    ),
    MalformedCase(
        "llm-http-sp-empty-stop",
        "http",
        "llm",
        sampling('{"stop": [""]}'),
        "stop must contain non-empty strings",
    ),
    MalformedCase(
        "llm-http-sp-stop-token-outside-vocab",
        "http",
        "llm",
        sampling('{"stop_token_ids": [1000000]}'),
        "stop_token_ids must hold token ids in [0, 4096)",
    ),
    MalformedCase(
        "llm-http-sp-bool-not-bool",
        "http",
        "llm",
        sampling('{"ignore_eos": "maybe"}'),
        "ignore_eos must be a boolean",
    ),
    MalformedCase(
        "llm-http-sp-greedy-n2",
        "http",
        "llm",
        sampling('{"temperature": 0, "n": 2}'),
        "n must be 1 when using greedy sampling",
    ),
    # --- llm over HTTP /generate: scalar inputs, prompt, body -----------------------------------
    MalformedCase(
        "llm-http-nan-temperature",
        "http",
        "llm",
        Generate(b'{"text_input": "ROMEO:", "temperature": NaN}'),
        "input 'temperature' must be a finite number, got nan",
    ),
    MalformedCase(
        "llm-http-negative-temperature",
        "http",
        "llm",
        Generate({"text_input": "ROMEO:", "temperature": -2.0}),
        "temperature must be >= 0, got -2.0",
    ),
    MalformedCase(
        "llm-http-negative-max-tokens",
        "http",
        "llm",
        Generate({"text_input": "ROMEO:", "max_tokens": -5}),
        "max_tokens must be >= 1, got -5",
    ),
    MalformedCase(
        "llm-http-max-tokens-not-integer",
        "http",
        "llm",
        Generate({"text_input": "ROMEO:", "max_tokens": "ten"}),
        "non-signed-integer as signed-integer",
    ),
    MalformedCase(
        "llm-http-prompt-not-string",
        "http",
        "llm",
        Generate({"text_input": 5}),
        "non-string as string",
    ),
    MalformedCase(
        "llm-http-empty-prompt",
        "http",
        "llm",
        Generate({"text_input": ""}),
        "input 'text_input' is empty",
    ),
    MalformedCase(
        "llm-http-prompt-over-max-model-len",
        "http",
        "llm",
        Generate({"text_input": "word " * 3000}),
        "but max_model_len is 1024",
    ),
    MalformedCase(
        "llm-http-prompt-over-max-bytes",
        "http",
        "llm",
        Generate({"text_input": "a" * ((1 << 20) + 1)}),
        "is 1048577 bytes, over the limit of 1048576 bytes",
    ),
    MalformedCase(
        "llm-http-missing-prompt",
        "http",
        "llm",
        Generate({"max_tokens": 3}),
        "missing required input 'text_input'",
    ),
    MalformedCase(
        "llm-http-stream-with-prompt-echo",
        "http",
        "llm",
        Generate(
            {"text_input": "ROMEO:", "stream": True, "exclude_input_in_output": False}, stream=True
        ),
        "exclude_input_in_output=false is not allowed",
    ),
    MalformedCase(
        "llm-http-invalid-json-body",
        "http",
        "llm",
        Generate(b"{nope"),
        "failed to parse the request JSON",
    ),
    MalformedCase(
        "llm-http-unknown-model",
        "http",
        "nosuch",
        Generate({"text_input": "hi"}),
        "unknown model: 'nosuch'",
    ),
    MalformedCase(
        "llm-http-unknown-version",
        "http",
        "llm",
        Generate({"text_input": "hi"}, version="7"),
        "'llm' version 7 is not found",
    ),
    MalformedCase(
        "llm-http-infer-on-decoupled",
        "http",
        "llm",
        Infer((PROMPT,)),
        "doesn't support models with decoupled transaction policy",
    ),
    # --- llm over a gRPC stream ---------------------------------------------------------------
    MalformedCase(
        "llm-grpc-prompt-int32",
        "grpc",
        "llm",
        Infer((("text_input", scalar(1, np.int32), "INT32"),)),
        "data-type is 'INT32', but model 'llm' expects 'BYTES'",
    ),
    MalformedCase(
        "llm-grpc-two-prompts",
        "grpc",
        "llm",
        Infer((("text_input", strings("a", "b"), "BYTES"),)),
        "Expected [1], got [2]",
    ),
    MalformedCase(
        "llm-grpc-invalid-utf8-prompt",
        "grpc",
        "llm",
        Infer((("text_input", strings(b"\xff\xfeROMEO"), "BYTES"), STREAM)),
        "input 'text_input'[0] is not valid UTF-8",
    ),
    MalformedCase(
        "llm-grpc-nan-temperature",
        "grpc",
        "llm",
        llm_stream(("temperature", scalar(np.nan, np.float32), "FP32")),
        "input 'temperature' must be a finite number, got nan",
    ),
    MalformedCase(
        "llm-grpc-inf-top-p",
        "grpc",
        "llm",
        llm_stream(("top_p", scalar(np.inf, np.float32), "FP32")),
        "input 'top_p' must be a finite number, got inf",
    ),
    MalformedCase(
        "llm-grpc-penalty-out-of-range",
        "grpc",
        "llm",
        llm_stream(("presence_penalty", scalar(5.0, np.float32), "FP32")),
        "presence_penalty must be in [-2, 2], got 5.0",
    ),
    MalformedCase(
        "llm-grpc-negative-max-tokens",
        "grpc",
        "llm",
        llm_stream(("max_tokens", scalar(-3, np.int32), "INT32")),
        "max_tokens must be >= 1, got -3",
    ),
    MalformedCase(
        "llm-grpc-stream-flag-int32",
        "grpc",
        "llm",
        Infer((PROMPT, ("stream", scalar(1, np.int32), "INT32"))),
        "data-type is 'INT32', but model 'llm' expects 'BOOL'",
    ),
    MalformedCase(
        "llm-grpc-sp-invalid-utf8",
        "grpc",
        "llm",
        llm_stream(("sampling_parameters", strings(b"{\xff}"), "BYTES")),
        "input 'sampling_parameters'[0] is not valid UTF-8",
    ),
    MalformedCase(
        "llm-grpc-sp-not-object",
        "grpc",
        "llm",
        llm_stream(("sampling_parameters", strings('"greedy"'), "BYTES")),
        "must be a JSON object, got str",
    ),
    MalformedCase(
        "llm-grpc-stop-words-invalid-utf8",
        "grpc",
        "llm",
        llm_stream(("stop_words", strings(b"\xc3\x28"), "BYTES")),
        "input 'stop_words'[0] is not valid UTF-8",
    ),
    MalformedCase(
        "llm-grpc-prompt-over-max-model-len",
        "grpc",
        "llm",
        Infer((("text_input", strings("word " * 3000), "BYTES"), STREAM)),
        "but max_model_len is 1024",
    ),
    MalformedCase(
        "llm-grpc-missing-prompt",
        "grpc",
        "llm",
        Infer((STREAM,)),
        "missing required input 'text_input'",
    ),
    MalformedCase(
        "llm-grpc-unknown-model", "grpc", "llmx", Infer((PROMPT, STREAM)), "unknown model: 'llmx'"
    ),
    MalformedCase(
        "llm-grpc-unknown-version",
        "grpc",
        "llm",
        Infer((PROMPT, STREAM), version="2"),
        "'llm' version 2 is not found",
    ),
    MalformedCase(
        "llm-grpc-unary-infer-on-decoupled",
        "grpc",
        "llm",
        Infer((PROMPT,), unary=True),
        "doesn't support models with decoupled transaction policy",
    ),
    # --- embedding ------------------------------------------------------------------------------
    MalformedCase(
        "embedding-http-empty-batch",
        "http",
        "embedding",
        Infer((("text_input", np.zeros((0, 1), dtype=object), "BYTES"),)),
        "inference input 'text_input' for model 'embedding', got 0",
    ),
    MalformedCase(
        "embedding-http-missing-input",
        "http",
        "embedding",
        Infer(()),
        "request has 0 inputs",  # text_input and input_ids are both optional: Triton's own check
    ),
    MalformedCase(
        "embedding-http-neither-texts-nor-ids",
        "http",
        "embedding",
        Infer((("normalize", np.array([[True]]), "BOOL"),)),
        "send exactly one of 'text_input' (texts) and 'input_ids' (token ids)",
    ),
    MalformedCase(
        "embedding-http-token-id-outside-vocabulary",
        "http",
        "embedding",
        Infer((("input_ids", np.array([[101, 10**6, 102]], dtype=np.int64), "INT64"),)),
        "token id 1000000 is outside the vocabulary",
    ),
    MalformedCase(
        "embedding-http-int32-text",
        "http",
        "embedding",
        Infer((("text_input", np.ones((1, 1), np.int32), "INT32"),)),
        "data-type is 'INT32', but model 'embedding' expects 'BYTES'",
    ),
    MalformedCase(
        "embedding-http-wrong-shape",
        "http",
        "embedding",
        Infer((("text_input", rows("a", "b").reshape(1, 2), "BYTES"),)),
        "Expected [-1,1], got [1,2]",
    ),
    MalformedCase(
        "embedding-http-oversized-batch",
        "http",
        "embedding",
        Infer((("text_input", rows(*["x"] * 65), "BYTES"),)),
        "batch-size must be <= 64",
    ),
    MalformedCase(
        "embedding-http-invalid-utf8",
        "http",
        "embedding",
        Infer((("text_input", rows("fine", b"\xff\xfebroken"), "BYTES"),)),
        "input 'text_input'[1] is not valid UTF-8",
    ),
    MalformedCase(
        "embedding-http-truncate-int8",
        "http",
        "embedding",
        Infer((("text_input", rows("a"), "BYTES"), ("truncate", np.ones((1, 1), np.int8), "INT8"))),
        "'truncate' data-type is 'INT8', but model 'embedding' expects 'BOOL'",
    ),
    MalformedCase(
        "embedding-http-unknown-input",
        "http",
        "embedding",
        Infer((("text_input", rows("a"), "BYTES"), ("colour", rows("red"), "BYTES"))),
        "unexpected inference input 'colour'",
    ),
    MalformedCase(
        "embedding-http-unknown-version",
        "http",
        "embedding",
        Infer((("text_input", rows("a"), "BYTES"),), version="3"),
        "'embedding' version 3 is not found",
    ),
    MalformedCase(
        "embedding-http-too-long-untruncated",
        "http",
        "embedding",
        Infer(
            (
                ("text_input", rows("word " * 400), "BYTES"),
                ("truncate", np.zeros((1, 1), bool), "BOOL"),
            )
        ),
        "over the limit of 256 (max_seq_length) and truncation is off",
    ),
    MalformedCase(
        "embedding-grpc-invalid-utf8",
        "grpc",
        "embedding",
        Infer((("text_input", rows(b"ok", b"\xed\xa0\x80"), "BYTES"),)),
        "input 'text_input'[1] is not valid UTF-8",
    ),
    MalformedCase(
        "embedding-grpc-oversized-batch",
        "grpc",
        "embedding",
        Infer((("text_input", rows(*["x"] * 100), "BYTES"),)),
        "batch-size must be <= 64",
    ),
    MalformedCase(
        "embedding-grpc-unknown-model",
        "grpc",
        "embeddings",
        Infer((("text_input", rows("a"), "BYTES"),)),
        "unknown model: 'embeddings'",
    ),
    MalformedCase(
        "embedding-grpc-normalize-batch-mismatch",
        "grpc",
        "embedding",
        Infer(
            (
                ("text_input", rows("a", "b", "c"), "BYTES"),
                ("normalize", np.ones((2, 1), bool), "BOOL"),
            )
        ),
        "batch size does not match other inputs",
    ),
    MalformedCase(
        "embedding-grpc-too-long-untruncated",
        "grpc",
        "embedding",
        Infer(
            (
                ("text_input", rows("short", "word " * 400), "BYTES"),
                ("truncate", np.zeros((2, 1), bool), "BOOL"),
            )
        ),
        "text 1 has 402 tokens, over the limit of 256",
    ),
    # --- rerank ---------------------------------------------------------------------------------
    MalformedCase(
        "rerank-http-missing-document",
        "http",
        "rerank",
        Infer((("query", rows("q"), "BYTES"),)),
        "missing required input(s) ['document']",
    ),
    MalformedCase(
        "rerank-http-batch-mismatch",
        "http",
        "rerank",
        Infer((("query", rows("q"), "BYTES"), ("document", rows("a", "b"), "BYTES"))),
        "batch size does not match other inputs",
    ),
    MalformedCase(
        "rerank-http-invalid-utf8-document",
        "http",
        "rerank",
        Infer((("query", rows("q"), "BYTES"), ("document", rows(b"\xc3\x28"), "BYTES"))),
        "input 'document'[0] is not valid UTF-8",
    ),
    MalformedCase(
        "rerank-http-fp32-query",
        "http",
        "rerank",
        Infer((("query", np.ones((1, 1), np.float32), "FP32"), ("document", rows("a"), "BYTES"))),
        "data-type is 'FP32', but model 'rerank' expects 'BYTES'",
    ),
    MalformedCase(
        "rerank-grpc-fp32-document",
        "grpc",
        "rerank",
        Infer((("query", rows("q"), "BYTES"), ("document", np.ones((1, 1), np.float32), "FP32"))),
        "data-type is 'FP32', but model 'rerank' expects 'BYTES'",
    ),
    MalformedCase(
        "rerank-grpc-oversized-batch",
        "grpc",
        "rerank",
        Infer((("query", rows(*["q"] * 65), "BYTES"), ("document", rows(*["d"] * 65), "BYTES"))),
        "batch-size must be <= 64",
    ),
    MalformedCase(
        "rerank-grpc-invalid-utf8-query",
        "grpc",
        "rerank",
        Infer((("query", rows(b"\x80"), "BYTES"), ("document", rows("d"), "BYTES"))),
        "input 'query'[0] is not valid UTF-8",
    ),
    MalformedCase(
        "rerank-grpc-unknown-version",
        "grpc",
        "rerank",
        Infer((("query", rows("q"), "BYTES"), ("document", rows("d"), "BYTES")), version="5"),
        "'rerank' version 5 is not found",
    ),
]


def send(case: MalformedCase, http_url: str, grpc_url: str) -> str | None:
    """Play one case; the error message it got, or None when the server accepted it."""
    request = case.request
    try:
        if isinstance(request, Generate):
            return _send_generate(case.model, request, http_url)
        if case.protocol == "http":
            _http_infer(case.model, request, http_url)
        elif case.model.startswith("llm") and not request.unary:
            return _grpc_stream(case.model, request, grpc_url)
        else:
            _grpc_infer(case.model, request, grpc_url)
    except InferenceServerException as exc:
        return str(exc)
    return None


def _send_generate(model: str, request: Generate, url: str) -> str | None:
    path = f"/v2/models/{model}" + (f"/versions/{request.version}" if request.version else "")
    path += "/generate_stream" if request.stream else "/generate"
    data = request.body if isinstance(request.body, bytes) else json.dumps(request.body).encode()
    http_request = urllib.request.Request(
        f"http://{url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(http_request, timeout=TIMEOUT) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
    # The error is a JSON object, or a server-sent event `data: {...}` when streaming.
    for line in text.splitlines() or [text]:
        try:
            body = json.loads(line.removeprefix("data:").strip())
        except ValueError:
            continue
        if isinstance(body, dict) and "error" in body:
            return body["error"]
    return None


def _http_infer(model: str, request: Infer, url: str) -> None:
    client = httpclient.InferenceServerClient(url, network_timeout=TIMEOUT)
    inputs = []
    for name, array, datatype in request.tensors:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    try:
        client.infer(model, inputs, model_version=request.version)
    finally:
        client.close()


def _grpc_inputs(request: Infer) -> list:
    inputs = []
    for name, array, datatype in request.tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _grpc_infer(model: str, request: Infer, url: str) -> None:
    client = grpcclient.InferenceServerClient(url)
    try:
        client.infer(
            model, _grpc_inputs(request), model_version=request.version, client_timeout=TIMEOUT
        )
    finally:
        client.close()


def _grpc_stream(model: str, request: Infer, url: str) -> str | None:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: results.put((result, error)), stream_timeout=TIMEOUT
    )
    try:
        client.async_stream_infer(model, _grpc_inputs(request), model_version=request.version)
        while True:
            result, error = results.get(timeout=TIMEOUT)
            if error is not None:
                return str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
