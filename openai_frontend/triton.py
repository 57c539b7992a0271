"""The gRPC aio client to tritonserver: the llm's decoupled stream, encoder inference, the index,
and the facts an llm publishes (backend_lib/contract.py holds every tensor name used here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

from backend_lib import contract
from openai_frontend.errors import (
    APIError,
    from_stream_error,
    from_triton_exception,
    internal,
    unavailable,
)

_LENGTH = struct.Struct("<I")
LLM_FLAGS = tuple(
    flag
    for flag in contract.RETURN_FLAGS
    if flag not in ("return_cumulative_logprob", "return_logprobs")
)
"""The `return_*` flags of every generate request (`return_logprobs` only when asked)."""


@dataclass
class LLMResponse:
    """One response of the llm stream: per choice, the new text, tokens and logprobs."""

    texts: list[str]
    finish_reasons: list[str | None]
    num_output_tokens: list[int]
    num_input_tokens: int
    logprobs: list[list[dict[str, dict[str, Any]]] | None] = field(default_factory=list)
    final: bool = False
    prompt_logprobs: list[dict[str, dict[str, Any]]] | None = None
    """Per prompt token, the prompt token first (contract.PROMPT_LOGPROBS); in the first response
    after the prefill of a request that asked for them, else None."""
    stop_reasons: list[int | str | None] = field(default_factory=list)
    """Per choice, vLLM's `stop_reason` (contract.STOP_REASON): the stop string or stop token id
    that finished it; None for EOS, length, or a choice still running."""
    num_cached_tokens: int = 0
    """The prompt tokens the engine read from its prefix cache (contract.NUM_CACHED_TOKENS)."""

    def __post_init__(self) -> None:
        if not self.stop_reasons:
            self.stop_reasons = [None] * len(self.texts)


def _tensor(name: str, value: np.ndarray) -> InferInput:
    item = InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    item.set_data_from_numpy(value)
    return item


def _strings(values: list[str]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=object)


def _finish_reason(raw: bytes) -> str | None:
    text = raw.decode()
    return None if text in ("None", "") else text


def _bytes_items(data: bytes) -> list[bytes]:
    """A serialized BYTES tensor's items (each a little-endian uint32 length, then the bytes)."""
    items, offset, size = [], 0, len(data)
    while offset < size:
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += 4
        items.append(data[offset : offset + length])
        offset += length
    return items


def _outputs(response: Any) -> dict[str, list[Any]]:
    """{output name: its items} of a ModelInferResponse, read in one pass (the profile of a
    16-stream load had `InferResult.as_numpy`, a linear search per output, as the frontend's
    largest cost after the socket writes)."""
    raw = response.raw_output_contents
    values: dict[str, list[Any]] = {}
    for index, output in enumerate(response.outputs):
        if index >= len(raw):
            values[output.name] = list(output.contents.bytes_contents)
        elif output.datatype == "BYTES":
            values[output.name] = _bytes_items(raw[index])
        else:
            dtype = triton_to_np_dtype(output.datatype)
            values[output.name] = np.frombuffer(raw[index], dtype=dtype).tolist()
    return values


def parse_llm_response(result: Any) -> LLMResponse:
    """An `InferResult` of the llm as an LLMResponse."""
    response = result.get_response()
    outputs = _outputs(response)
    texts = [t.decode("utf-8", errors="replace") for t in outputs[contract.TEXT_OUTPUT]]
    n = len(texts)
    reasons = [_finish_reason(r) for r in outputs.get(contract.FINISH_REASON, [b""] * n)]
    out_tokens = [int(v) for v in outputs.get(contract.NUM_OUTPUT_TOKENS, [0] * n)]
    in_tokens = int(outputs.get(contract.NUM_INPUT_TOKENS, [0])[0])
    logprobs = [json.loads(v) for v in outputs.get(contract.LOGPROBS, [])] or [None] * n
    final = response.parameters["triton_final_response"].bool_param
    scored = outputs.get(contract.PROMPT_LOGPROBS)
    prompt_logprobs = json.loads(scored[0]) if scored else None
    stops = [json.loads(v) for v in outputs.get(contract.STOP_REASON, [])]
    cached = int(outputs.get(contract.NUM_CACHED_TOKENS, [0])[0])
    return LLMResponse(
        texts, reasons, out_tokens, in_tokens, logprobs, final, prompt_logprobs, stops, cached
    )


class TritonClient:
    """One gRPC channel to tritonserver, shared by every request of the frontend."""

    def __init__(self, url: str, admin_key: str | None = None, timeout_s: float = 600.0):
        self.url = url
        self.timeout_s = timeout_s
        # tritonserver expects a restricted gRPC protocol's header with this prefix
        # (`--grpc-restricted-protocol=model-repository:triton-admin-key=...`, as make serve sets).
        self._admin_headers = (
            {"triton-grpc-protocol-triton-admin-key": admin_key} if admin_key else None
        )
        self._client: grpcaio.InferenceServerClient | None = None

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        # Created lazily: the aio channel belongs to the event loop that first uses it.
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def is_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready(client_timeout=5))
        except Exception:
            return False

    async def repository_index(self) -> list[dict[str, Any]]:
        try:
            index = await self.client.get_model_repository_index(
                headers=self._admin_headers, as_json=True, client_timeout=10
            )
        except InferenceServerException as exc:
            raise from_triton_exception(exc) from None
        return list(index.get("models", []))

    async def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        try:
            config = await self.client.get_model_config(
                name, version, as_json=True, client_timeout=10
            )
        except InferenceServerException as exc:
            raise from_triton_exception(exc) from None
        return dict(config.get("config", {}))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: list[str],
        version: str = "",
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray | None]:
        """The `outputs` of one inference by `version` of `model` (""; the newest); None for an
        output the model did not send. `timeout_us`: the request's Triton timeout (microseconds;
        the encoders end it with deadline_exceeded past it)."""
        try:
            result = await self.client.infer(
                model,
                [_tensor(name, value) for name, value in inputs.items()],
                model_version=version,
                timeout=timeout_us,
                client_timeout=self.timeout_s,
            )
        except InferenceServerException as exc:
            raise from_triton_exception(exc) from None
        return {name: result.as_numpy(name) for name in outputs}

    async def model_facts(self, model: str, version: str) -> contract.ModelFacts:
        """What version `version` of the llm `model` publishes about itself: its answer to a
        `describe` request (one final response; nothing is generated)."""
        inputs = [
            _tensor(contract.TEXT_INPUT, _strings([""])),
            _tensor(contract.DESCRIBE, np.array([True])),
        ]
        request = {"model_name": model, "model_version": version, "inputs": inputs}
        async with contextlib.aclosing(self._stream(request)) as results:
            async for result in results:
                facts = _outputs(result.get_response()).get(contract.MODEL_FACTS)
                try:
                    return contract.ModelFacts.from_json(facts[0] if facts else b"")
                except ValueError as exc:
                    raise internal(
                        f"model `{model}` version {version} published no valid facts: {exc}"
                    ) from None
        raise unavailable("the stream ended without a final response")

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        sampling_parameters: Mapping[str, Any],
        *,
        stream: bool,
        logprobs: bool = False,
        version: str = "",
        images: list[bytes] | None = None,
    ) -> AsyncIterator[LLMResponse]:
        """The llm's responses for one prompt (a text or token ids) and its `images` (encoded
        files, the llm's `image` input). Leaving the loop early (a
        client gone, an exception) cancels the gRPC stream, which aborts the engine request."""
        text = prompt if isinstance(prompt, str) else ""
        inputs = [
            _tensor(contract.TEXT_INPUT, _strings([text])),
            _tensor(contract.STREAM, np.array([stream])),
            _tensor(contract.SAMPLING_PARAMETERS, _strings([json.dumps(sampling_parameters)])),
            _tensor(contract.EXCLUDE_INPUT_IN_OUTPUT, np.array([True])),
        ]
        if not isinstance(prompt, str):
            inputs.append(_tensor(contract.PROMPT_TOKEN_IDS, np.array(prompt, dtype=np.int64)))
        if images:
            inputs.append(_tensor(contract.IMAGE, np.array(images, dtype=object)))
        flags = LLM_FLAGS + (("return_logprobs",) if logprobs else ())
        inputs += [_tensor(flag, np.array([True])) for flag in flags]
        request = {"model_name": model, "model_version": version, "inputs": inputs}
        async with contextlib.aclosing(self._stream(request)) as results:  # closing cancels it
            async for result in results:
                yield parse_llm_response(result)

    async def _stream(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        """The results of one request on a decoupled model, until its final response; an error
        response raises its APIError (by the code it carries, contract.decode_error)."""
        done = asyncio.Event()

        async def requests():
            yield request
            # Keep our side of the stream open until the final response: a half-closed stream
            # could end before the decoupled model is done.
            await done.wait()

        try:
            responses = self.client.stream_infer(requests(), stream_timeout=self.timeout_s)
        except InferenceServerException as exc:
            raise from_triton_exception(exc) from None
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise from_stream_error(str(error.message() or error))
                finished = result.get_response().parameters["triton_final_response"].bool_param
                yield result
                if finished:
                    return
            raise unavailable("the stream ended without a final response")
        except APIError:
            raise
        except InferenceServerException as exc:
            raise from_triton_exception(exc) from None
        except grpc.aio.AioRpcError as exc:  # the stream itself failed (connection, deadline)
            raise from_triton_exception(
                InferenceServerException(msg=exc.details(), status=str(exc.code()))
            ) from None
        finally:
            done.set()  # half-close: after the final response the RPC ends on its own
            if not finished:
                # Cancelling a finished stream left tritonserver waiting for it at shutdown
                # (its full exit timeout, 30 s, after a 16-stream benchmark).
                responses.cancel()
