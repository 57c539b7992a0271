"""Independent references for the frontend's answers: the models called directly through
tritonclient (gRPC for the llm, HTTP for the encoders), and the llm engine's metrics."""

from __future__ import annotations

import json
import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.llm_client import llm_inputs
from tooling.tritonserver import TritonServer

SHAKESPEARE_CHAT = "[A street in Verona.]\n\nUSER:\nWho goes there?\n\nASSISTANT:\n"
CHAT_MESSAGES = [
    {"role": "system", "content": "A street in Verona."},
    {"role": "user", "content": "Who goes there?"},
]

API_KEY = "sk-test-key"
"""The bearer token of the frontend that requires one (tests of 401)."""


def llm_generate(server: TritonServer, prompt: str, params: dict) -> tuple[list[str], list[str]]:
    """The llm's own texts and finish reasons (one non-streaming request, n choices)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            "llm", llm_inputs(prompt, params, False, True, ("return_finish_reason",))
        )
        result, error = results.get(timeout=120)
        assert error is None, error
        texts = [t.decode() for t in result.as_numpy("text_output")]
        reasons = [r.decode() for r in result.as_numpy("finish_reason")]
        return texts, reasons
    finally:
        client.stop_stream()
        client.close()


def _strings(name: str, values: list[str]) -> httpclient.InferInput:
    item = httpclient.InferInput(name, [len(values), 1], "BYTES")
    item.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=object))
    return item


def embeddings(server: TritonServer, texts: list[str]) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    return client.infer("embedding", [_strings("text_input", texts)]).as_numpy("embedding")


def rerank_scores(server: TritonServer, query: str, documents: list[str]) -> list[float]:
    client = httpclient.InferenceServerClient(server.http_url)
    result = client.infer(
        "rerank", [_strings("query", [query] * len(documents)), _strings("document", documents)]
    )
    return [float(v) for v in result.as_numpy("score").reshape(-1)]


def engine_metric(server: TritonServer, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == "llm":
                total += sample.value
    return total


def wait_engine_idle(server: TritonServer, timeout: float = 30) -> tuple[float, float]:
    """(running requests, KV-cache usage) once both are 0, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        values = (
            engine_metric(server, "vllm:num_requests_running"),
            engine_metric(server, "vllm:kv_cache_usage_perc"),
        )
        if values == (0, 0) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream, and "[DONE]" for the end marker."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
