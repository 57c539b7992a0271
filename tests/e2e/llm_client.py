"""Small clients for the llm model used by end-to-end tests and benchmarks: gRPC streaming
(tritonclient), HTTP `generate` and `generate_stream` (plain urllib, as curl would)."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass
class StreamResult:
    pieces: list[str] = field(default_factory=list)
    responses: list[dict] = field(default_factory=list)
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def llm_inputs(
    prompt: str,
    params: dict | None = None,
    stream: bool = True,
    exclude_input: bool | None = True,
    flags: tuple[str, ...] = (),
) -> list:
    def tensor(name: str, value, datatype: str):
        item = grpcclient.InferInput(name, [1], datatype)
        item.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        return item

    inputs = [tensor("text_input", prompt.encode(), "BYTES"), tensor("stream", stream, "BOOL")]
    if params is not None:
        inputs.append(tensor("sampling_parameters", json.dumps(params).encode(), "BYTES"))
    if exclude_input is not None:
        inputs.append(tensor("exclude_input_in_output", exclude_input, "BOOL"))
    inputs += [tensor(flag, True, "BOOL") for flag in flags]
    return inputs


def grpc_stream(
    url: str,
    prompt: str,
    params: dict | None = None,
    model: str = "llm",
    flags: tuple[str, ...] = (),
    cancel_after: int | None = None,
    timeout: float = 300,
    model_version: str = "",
) -> StreamResult:
    """Stream one request over gRPC; with `cancel_after`, cancel once that many responses came.
    `timeout` bounds the whole stream (its gRPC deadline) and each wait for a response: a server
    that never answers fails the call, it never hangs."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: results.put((result, error)), stream_timeout=timeout
    )
    out = StreamResult()
    finished = False
    try:
        client.async_stream_infer(
            model, llm_inputs(prompt, params, True, True, flags), model_version=model_version
        )
        while True:
            try:
                result, error = results.get(timeout=timeout)
            except queue.Empty:
                out.error = f"no response within {timeout} s"
                return out
            if error is not None:
                out.error = str(error)
                finished = True  # the stream has ended
                return out
            response = result.get_response()
            record = {name: result.as_numpy(name) for name in [o.name for o in response.outputs]}
            out.responses.append(record)
            if "text_output" in record:
                out.pieces.append(b"".join(record["text_output"]).decode())
            if response.parameters["triton_final_response"].bool_param:
                finished = True
                return out
            if cancel_after is not None and len(out.responses) >= cancel_after:
                return out
    finally:
        # A plain close waits for the server to end the stream: one left early is cancelled.
        client.stop_stream(cancel_requests=not finished)
        client.close()


def http_generate(url: str, body: dict, model: str = "llm", version: str = "") -> dict:
    """POST /v2/models/<model>[/versions/<v>]/generate; raises HTTPError with the server's text."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/generate"
    request = urllib.request.Request(
        f"http://{url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def http_generate_stream(url: str, body: dict, model: str = "llm") -> list[dict]:
    """POST /generate_stream; the server-sent events as dicts."""
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


def http_error_text(exc: urllib.error.HTTPError) -> str:
    return exc.read().decode(errors="replace")
