"""End to end: a `tensor_parallel_size: 2` llm and a `pipeline_parallel_size: 2` one (rank 0 in
its Triton stub, rank 1 a worker process it starts) served by a real tritonserver beside a
single-device one on the same checkpoint: the same greedy text, streamed and not; a worker killed
mid-stream ends that request with an error naming the rank, no hang, the other models still
serve; stopping the server leaves no worker process; several nodes, with tensor or pipeline
parallelism across them."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.llm_client import grpc_stream, http_generate
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tests.llm.tensor_parallel_helpers import worker_pids
from tests.server_helpers import start_server, stop_server
from tooling.repository import ModelSpec, write_model
from tooling.tritonserver import TritonServer

pytestmark = pytest.mark.e2e

PARAMS = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PROMPTS = ("ROMEO:\nWhat light", "JULIET:\nO Romeo, Romeo,")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Iterator[TritonServer]:
    """One tritonserver for the module, under explicit
    model control as the Helm chart runs it, serving the Shakespeare model three ways: `llm` on
    one device, `llm_tp2` and `llm_pp2` each with a worker process for rank 1. The tests run in
    file order on it: a worker of each sharded model is killed in turn, and the last test stops
    the server."""
    repository = tmp_path_factory.mktemp("sharded-repo")
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    for name, extra in (
        ("llm", {}),
        ("llm_tp2", {"tensor_parallel_size": "2"}),
        ("llm_pp2", {"pipeline_parallel_size": "2"}),
    ):
        write_model(ModelSpec(name, "llm", {**common, **extra}, max_batch_size=0), repository)
    server = start_server(repository, ["--model-control-mode=explicit", "--load-model=*"])
    yield server
    stop_server(server)


def _workers_of(server: TritonServer) -> set[int]:
    """The live worker processes in the server's process tree (other tests may run workers of
    their own beside it)."""
    return {pid for pid in worker_pids() if _descends_from(pid, server.process.pid)}


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status if line.startswith("PPid:")))
        if pid == ancestor:
            return True
    return False


def body(prompt: str, max_tokens: int = 12) -> dict:
    params = {**PARAMS, "max_tokens": max_tokens}
    return {
        "text_input": prompt,
        "sampling_parameters": json.dumps(params),
        "exclude_input_in_output": True,
    }


def test_a_sharded_llm_serves_beside_a_single_device_one(sharded):
    server = sharded
    workers = _workers_of(server)
    assert len(workers) == 2  # rank 1 of llm_tp2, stage 1 of llm_pp2
    for prompt in PROMPTS:
        expected = http_generate(server.http_url, body(prompt), model="llm")["text_output"]
        for model in ("llm_tp2", "llm_pp2"):
            sharded_text = http_generate(server.http_url, body(prompt), model=model)
            assert sharded_text["text_output"] == expected, model
            streamed = grpc_stream(server.grpc_url, prompt, PARAMS, model=model)
            assert streamed.error is None and "".join(streamed.pieces) == expected, model

    # A worker killed mid-stream: that request ends with an error naming the rank, at once.
    started = time.monotonic()
    long = {**PARAMS, "max_tokens": 200}
    (worker,) = [pid for pid in workers if _worker_of(pid, pipeline_parallel_size=1)]
    stream = grpc_stream(
        server.grpc_url, PROMPTS[0], long, model="llm_tp2", cancel_after=2, timeout=60
    )
    assert stream.error is None  # two pieces arrived; the stream was then left
    os.kill(worker, signal.SIGKILL)
    failure = _failure(grpc_stream(server.grpc_url, PROMPTS[1], long, model="llm_tp2", timeout=60))
    assert "tensor-parallel rank 1" in failure, failure
    assert time.monotonic() - started < 60
    # The other models are untouched.
    for model in ("llm", "llm_pp2"):
        assert http_generate(server.http_url, body(PROMPTS[0]), model=model)["text_output"]


def _failure(stream) -> str:
    """A stream's error: the transport's, or the error of its responses."""
    return stream.error or "".join(str(r.get("error", "")) for r in stream.responses)


def _worker_of(pid: int, pipeline_parallel_size: int) -> bool:
    """Whether worker `pid` serves the model of this pipeline_parallel_size (its command line
    carries the model's parallel settings)."""
    setting = f'"pipeline_parallel_size": {pipeline_parallel_size}'.encode()
    return setting in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.sample(1)
@pytest.mark.parametrize("across", ("tensor_parallel_size", "pipeline_parallel_size"))
def test_a_multi_node_llm_serves_with_a_worker_node_started_apart(across, tmp_path, make_server):
    """nnodes 2 on one machine: tritonserver's llm is node 0 (rank 0); rank 1 (the other
    tensor-parallel rank, or the second pipeline stage) is run by the worker-node entry point,
    started separately with a worker pod's environment, on the same model directory. Same text
    as the single-device model; stopping the server ends the node."""
    import subprocess
    import sys

    from tooling.tritonserver import free_port

    port = free_port()
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    sharded = {across: "2", "nnodes": "2", "master_port": str(port)}
    for name, extra in (("llm", {}), ("llm_nodes", sharded)):
        write_model(ModelSpec(name, "llm", {**common, **extra}, max_batch_size=0), tmp_path)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1"}
    command = [sys.executable, "-m", "backend_lib.llm.execution.worker_node"]
    node = subprocess.Popen([*command, "--model-dir", str(tmp_path / "llm_nodes")], env=env)
    try:
        server = make_server(tmp_path)
        for prompt in PROMPTS:
            expected = http_generate(server.http_url, body(prompt), model="llm")["text_output"]
            served = http_generate(server.http_url, body(prompt), model="llm_nodes")
            assert served["text_output"] == expected
        stop_server(server)
        assert node.wait(timeout=60) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_model_whose_worker_died_is_unloaded_and_loads_again(sharded):
    """The pipeline stage's worker is killed mid-stream; the next request fails naming the rank;
    the one after is refused as unavailable and makes the model ask to be unloaded (on its
    execute thread, as the vLLM backend calls `pb_utils.unload_model`), so it stops being ready;
    loading it again starts a new worker and it serves the single-device model's text again."""
    import urllib.request

    from tooling.tritonserver import http_status

    server = sharded
    (worker,) = [pid for pid in _workers_of(server) if _worker_of(pid, pipeline_parallel_size=2)]
    expected = http_generate(server.http_url, body(PROMPTS[0]), model="llm")["text_output"]
    long = {**PARAMS, "max_tokens": 200}
    stream = grpc_stream(server.grpc_url, PROMPTS[0], long, model="llm_pp2", cancel_after=2)
    assert stream.error is None
    os.kill(worker, signal.SIGKILL)
    failure = _failure(grpc_stream(server.grpc_url, PROMPTS[1], long, model="llm_pp2", timeout=60))
    assert "rank 1 (tensor-parallel rank 0 of pipeline stage 1" in failure, failure
    # The cancelled stream may still be stepping when the worker dies: the engine then knows
    # before this request, which is refused as unavailable itself (and asks for the unload).
    if "the model is unavailable" not in failure:
        refused = _failure(
            grpc_stream(server.grpc_url, PROMPTS[1], long, model="llm_pp2", timeout=60)
        )
        assert "the model is unavailable" in refused, refused

    ready = f"http://{server.http_url}/v2/models/llm_pp2/ready"
    deadline = time.monotonic() + 60
    while http_status(ready) == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert http_status(ready) != 200, server.log_tail(60)  # unloaded
    assert http_status(f"http://{server.http_url}/v2/models/llm/ready") == 200

    load = urllib.request.Request(
        f"http://{server.http_url}/v2/repository/models/llm_pp2/load", method="POST"
    )
    with urllib.request.urlopen(load, timeout=180) as response:
        assert response.status == 200
    assert http_generate(server.http_url, body(PROMPTS[0]), model="llm_pp2")["text_output"] == (
        expected
    )
    assert worker not in worker_pids()
    assert [pid for pid in _workers_of(server) if _worker_of(pid, pipeline_parallel_size=2)]


def test_stopping_the_server_leaves_no_worker(sharded):
    """Last on the module's server: after the kills and the reload above, stopping tritonserver
    unloads each model (its stub's finalize ends its workers) within the exit timeout and leaves
    no worker."""
    server = sharded
    alive = _workers_of(server)
    assert alive  # the reloaded llm_pp2's at least
    before = len(server.log_text())
    stop_server(server)
    shutdown = server.log_text()[before:]
    for name in ("llm", "llm_tp2", "llm_pp2"):
        assert f"successfully unloaded '{name}'" in shutdown, shutdown[-3000:]
    assert "Exit timeout expired" not in shutdown
    deadline = time.monotonic() + 30
    while set(worker_pids()) & alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(worker_pids()) & alive
