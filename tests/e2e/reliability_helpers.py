"""Pieces of the reliability suite (tests/e2e/test_reliability.py, test_soak.py): engine gauges from the
metrics port, /proc readings of tritonserver and its Python-backend stubs, llm requests that end in a
classified `Outcome` (optionally cancelled at a chosen point), and a background workload on all three
models that checks every answer against reference answers computed first."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from backend_lib.contract import ErrorCode, decode_error
from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import llm_inputs

REQUEST_TIMEOUT = 180.0
"""Seconds one request may take before it counts as stuck (generous: the machine is shared)."""
PROMPTS = (
    "ROMEO:",
    "JULIET:\nO Romeo,",
    "KING HENRY:\nNow, lords,",
    "First Citizen:\nBefore we",
    "HAMLET:\nTo be, or not",
    "MACBETH:\nIs this a dagger",
)
GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
ENCODER_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, 東京タワー, 🚀",
    "short",
    "Inference servers batch requests dynamically.",
)
RERANK_PAIRS = (
    ("what is a fox?", ENCODER_TEXTS[0]),
    ("where is Tokyo Tower?", ENCODER_TEXTS[1]),
    ("what is a fox?", ENCODER_TEXTS[3]),
)
ENGINE_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


# --- metrics ---------------------------------------------------------------------------------


def _labels(name: str, model: str, **labels: str) -> frozenset:
    """`model`, version 1; the llm metrics (vllm:*) also carry vLLM's `model_name`."""
    extra = {"model_name": model} if name.startswith("vllm:") else {}
    return frozenset({"model": model, "version": "1", **extra, **labels}.items())


def metric(server, name: str, model: str, **labels: str) -> float:
    """One sample of the metrics port (0 when absent), labelled with `model`, version 1."""
    wanted = _labels(name, model, **labels)
    return parse_prometheus_text(server.metrics_text()).get((name, wanted), 0.0)


def engine_gauges(server, model: str) -> dict[str, float]:
    samples = parse_prometheus_text(server.metrics_text())
    return {name: samples.get((name, _labels(name, model)), 0.0) for name in ENGINE_GAUGES}


def wait_engine_idle(server, model: str, timeout: float = 90.0) -> dict[str, float]:
    """Poll until KV usage, running and waiting are all 0; returns the last reading."""
    deadline = time.monotonic() + timeout
    gauges = engine_gauges(server, model)
    while any(gauges.values()) and time.monotonic() < deadline:
        time.sleep(0.25)
        gauges = engine_gauges(server, model)
    return gauges


# --- /proc -----------------------------------------------------------------------------------


def child_processes(pid: int) -> dict[int, list[str]]:
    """{pid: argv} of the live (not zombie) children of `pid`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = [a.decode(errors="replace") for a in cmdline.read().split(b"\0") if a]
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and argv:
            found[int(entry)] = argv
    return found


def stub_pid(server, model: str) -> int:
    """The Python-backend stub running `<repository>/<model>/1/model.py` under this server."""
    for pid, argv in child_processes(server.process.pid).items():
        if (
            "triton_python_backend_stub" in argv[0]
            and len(argv) > 1
            and argv[1].endswith(f"/{model}/1/model.py")
        ):
            return pid
    raise LookupError(f"no stub process of model {model!r}")


def proc_status(pid: int, key: str) -> int:
    """A numeric field of /proc/<pid>/status (VmRSS in kB, Threads)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_mb(server) -> dict[str, float]:
    """Resident memory (MB) of tritonserver and of each of its stubs, by model."""
    sizes = {"tritonserver": proc_status(server.process.pid, "VmRSS") / 1024}
    for pid, argv in child_processes(server.process.pid).items():
        name = argv[1].rsplit("/", 3)[-3] if len(argv) > 1 else str(pid)
        with contextlib.suppress(OSError, KeyError):  # exited meanwhile
            sizes[name] = proc_status(pid, "VmRSS") / 1024
    return sizes


# --- llm requests ----------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one request ended: completed, refused (queue full), errored, cancelled or stuck."""

    kind: str
    text: str = ""
    error: str = ""
    responses: int = 0


def classify_error(message: str) -> Outcome:
    """A refusal carries the queue_full code (backend_lib/contract.py); anything else (even a
    failure that mentions a full queue, e.g. a refusal after admission surfacing as "generation
    failed") is an error."""
    refused = decode_error(message)[0] is ErrorCode.QUEUE_FULL
    return Outcome("refused" if refused else "errored", error=message)


def grpc_request(
    url: str,
    model: str,
    prompt: str,
    params: dict,
    cancel_after: int | None = None,
    timeout: float = REQUEST_TIMEOUT,
) -> Outcome:
    """One streaming request over gRPC; with `cancel_after` (0 = at once) the client cancels it
    (stop_stream(cancel_requests=True)) once that many responses came."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    pieces: list[str] = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, llm_inputs(prompt, params))
        while True:
            if cancel_after is not None and len(pieces) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return Outcome("cancelled", "".join(pieces), responses=len(pieces))
            try:
                result, error = results.get(timeout=timeout)
            except queue.Empty:
                client.stop_stream(cancel_requests=True)  # a plain close would wait for it
                return Outcome("stuck", "".join(pieces), responses=len(pieces))
            if error is not None:
                outcome = classify_error(str(error))
                outcome.text, outcome.responses = "".join(pieces), len(pieces)
                return outcome
            response = result.get_response()
            pieces.append(b"".join(result.as_numpy("text_output")).decode())
            if response.parameters["triton_final_response"].bool_param:
                return Outcome("completed", "".join(pieces), responses=len(pieces))
    finally:
        client.close()


def http_stream_request(
    url: str,
    model: str,
    prompt: str,
    params: dict,
    cancel_after: int | None = None,
    timeout: float = REQUEST_TIMEOUT,
) -> Outcome:
    """One POST /generate_stream; with `cancel_after` (0 = before reading anything) the client
    closes the connection once that many events came."""
    host, port = url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    body = json.dumps(
        {
            "text_input": prompt,
            "stream": True,
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params),
        }
    )
    pieces: list[str] = []
    try:
        connection.request(
            "POST",
            f"/v2/models/{model}/generate_stream",
            body,
            {"Content-Type": "application/json"},
        )
        if cancel_after == 0:
            return Outcome("cancelled")
        response = connection.getresponse()
        if response.status != 200:  # refused before streaming began: one error body
            return classify_error(_error_text(response.read().decode(errors="replace")))
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                outcome = classify_error(event["error"])
                outcome.text, outcome.responses = "".join(pieces), len(pieces)
                return outcome
            pieces.append(_joined(event["text_output"]))
            if cancel_after is not None and len(pieces) >= cancel_after:
                return Outcome("cancelled", "".join(pieces), responses=len(pieces))
        return Outcome("completed", "".join(pieces), responses=len(pieces))
    except TimeoutError:
        return Outcome("stuck", "".join(pieces), responses=len(pieces))
    finally:
        if connection.sock is not None:
            connection.sock.close()  # a client going away mid-stream
        connection.close()


def http_generate_request(
    url: str, model: str, prompt: str, params: dict, timeout: float = REQUEST_TIMEOUT
) -> Outcome:
    """One POST /generate (non-streaming)."""
    body = {
        "text_input": prompt,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(params),
    }
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = _joined(json.loads(response.read())["text_output"])
            return Outcome("completed", text, responses=1)
    except urllib.error.HTTPError as exc:
        return classify_error(_error_text(exc.read().decode(errors="replace")))
    except TimeoutError:
        return Outcome("stuck")


def _joined(text_output: str | list[str]) -> str:
    """`text_output` of a JSON response: a string, or a list of them when n > 1."""
    return text_output if isinstance(text_output, str) else "".join(text_output)


def _error_text(body: str) -> str:
    """The message of an error body: `{"error": ...}`, or `data: {"error": ...}` when streaming."""
    try:
        return json.loads(body.strip().removeprefix("data:"))["error"]
    except (ValueError, KeyError, TypeError):
        return body


# --- encoders ----------------------------------------------------------------------------------


def _bytes_rows(values) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=object).reshape(-1, 1)


def embed(url: str, texts, timeout: float = REQUEST_TIMEOUT) -> np.ndarray:
    client = httpclient.InferenceServerClient(url, network_timeout=timeout)
    data = _bytes_rows(texts)
    tensor = httpclient.InferInput("text_input", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    try:
        return client.infer("embedding", [tensor]).as_numpy("embedding")
    finally:
        client.close()  # an open connection would hold up the server's shutdown


def rerank(grpc_url: str, pairs, timeout: float = REQUEST_TIMEOUT) -> np.ndarray:
    client = grpcclient.InferenceServerClient(grpc_url)
    inputs = []
    for name, values in (("query", [q for q, _ in pairs]), ("document", [d for _, d in pairs])):
        data = _bytes_rows(values)
        tensor = grpcclient.InferInput(name, list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    try:
        return client.infer("rerank", inputs, client_timeout=timeout).as_numpy("score")
    finally:
        client.close()


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# --- references and the background workload -----------------------------------------------------


@dataclass
class Reference:
    """Answers computed alone, before any stress: greedy texts per llm model, embeddings, scores."""

    texts: dict[str, dict[str, str]]
    embeddings: np.ndarray
    scores: np.ndarray


def compute_reference(server, llm_models: tuple[str, ...], params: dict | None = None) -> Reference:
    """Sequential requests on an otherwise idle server."""
    params = params or GREEDY
    texts: dict[str, dict[str, str]] = {}
    for model in llm_models:
        texts[model] = {}
        for prompt in PROMPTS:
            outcome = grpc_request(server.grpc_url, model, prompt, params)
            assert outcome.kind == "completed", outcome
            texts[model][prompt] = outcome.text
    return Reference(
        texts, embed(server.http_url, ENCODER_TEXTS), rerank(server.grpc_url, RERANK_PAIRS)
    )


def check_llm(
    server, reference: Reference, model: str, prompt: str, via_http: bool = False
) -> str | None:
    """One greedy request; a problem description, or None when the text is the reference's."""
    if via_http:
        outcome = http_generate_request(server.http_url, model, prompt, GREEDY)
    else:
        outcome = grpc_request(server.grpc_url, model, prompt, GREEDY)
    if outcome.kind != "completed":
        return f"{model} {prompt!r}: {outcome.kind} {outcome.error}"
    if outcome.text != reference.texts[model][prompt]:
        return f"{model} {prompt!r}: {outcome.text!r} != {reference.texts[model][prompt]!r}"
    return None


def check_encoders(server, reference: Reference) -> list[str]:
    problems = []
    try:
        similarity = cosine(embed(server.http_url, ENCODER_TEXTS), reference.embeddings).min()
        if similarity < 0.99999:
            problems.append(f"embedding drifted: min cosine {similarity}")
        scores = rerank(server.grpc_url, RERANK_PAIRS)
        if not np.allclose(scores, reference.scores, atol=1e-5):
            problems.append(f"rerank scores {scores.ravel()} != {reference.scores.ravel()}")
    except Exception as exc:  # any failure of a good request is a problem
        problems.append(f"encoder request failed: {exc}")
    return problems


@dataclass
class BackgroundTraffic:
    """A thread sending well-formed requests (llm greedy streams on `llm_models`, embedding, rerank)
    round after round, checking each answer against `reference`, until `stop()`."""

    server: object
    reference: Reference
    llm_models: tuple[str, ...]
    rounds: int = 0
    requests: int = 0
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="background-traffic", daemon=True)

    def start(self) -> BackgroundTraffic:
        self._thread.start()
        return self

    def wait_rounds(self, count: int, timeout: float = REQUEST_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.rounds < count and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT * 2)
        assert not self._thread.is_alive(), "background traffic is stuck"

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            for model in self.llm_models:
                prompt = PROMPTS[index % len(PROMPTS)]
                problem = check_llm(
                    self.server, self.reference, model, prompt, via_http=index % 2 == 1
                )
                self.requests += 1
                if problem:
                    self.problems.append(problem)
            self.problems += check_encoders(self.server, self.reference)
            self.requests += 2
            self.rounds += 1
            index += 1
