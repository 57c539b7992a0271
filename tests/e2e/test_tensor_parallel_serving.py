"""End to end: a `tensor_parallel_size: 2` llm (rank 0 in its Triton stub, rank 1 a worker
process it starts) served by a real tritonserver beside a single-device one on the same
checkpoint: the same greedy text, streamed and not; a worker killed mid-stream ends that request
with an error naming the rank, no hang, the other model still serves; stopping the server leaves
no worker process."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.llm_client import grpc_stream, http_generate
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tests.llm.tensor_parallel_helpers import worker_pids
from tooling.repository import ModelSpec, write_model

pytestmark = pytest.mark.e2e

PARAMS = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PROMPTS = ("ROMEO:\nWhat light", "JULIET:\nO Romeo, Romeo,")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    for name, extra in (("llm", {}), ("llm_tp2", {"tensor_parallel_size": "2"})):
        write_model(ModelSpec(name, "llm", {**common, **extra}, max_batch_size=0), tmp_path)
    return tmp_path


def body(prompt: str, max_tokens: int = 12) -> dict:
    params = {**PARAMS, "max_tokens": max_tokens}
    return {
        "text_input": prompt,
        "sampling_parameters": json.dumps(params),
        "exclude_input_in_output": True,
    }


def test_a_sharded_llm_serves_beside_a_single_device_one(repository, make_server):
    before = set(worker_pids())
    server = make_server(repository)
    workers = set(worker_pids()) - before
    assert len(workers) == 1  # rank 1 of llm_tp2
    for prompt in PROMPTS:
        expected = http_generate(server.http_url, body(prompt), model="llm")["text_output"]
        sharded = http_generate(server.http_url, body(prompt), model="llm_tp2")["text_output"]
        assert sharded == expected
        streamed = grpc_stream(server.grpc_url, prompt, PARAMS, model="llm_tp2")
        assert streamed.error is None and "".join(streamed.pieces) == expected

    # A worker killed mid-stream: that request ends with an error naming the rank, at once.
    started = time.monotonic()
    long = {**PARAMS, "max_tokens": 200}
    (worker,) = workers
    stream = grpc_stream(
        server.grpc_url, PROMPTS[0], long, model="llm_tp2", cancel_after=2, timeout=60
    )
    assert stream.error is None  # two pieces arrived; the stream was then left
    os.kill(worker, signal.SIGKILL)
    broken = grpc_stream(server.grpc_url, PROMPTS[1], long, model="llm_tp2", timeout=60)
    failure = broken.error or "".join(str(r.get("error", "")) for r in broken.responses)
    assert "tensor-parallel rank 1" in failure, broken
    assert time.monotonic() - started < 60
    # The single-device model is untouched.
    assert http_generate(server.http_url, body(PROMPTS[0]), model="llm")["text_output"]


def test_stopping_the_server_leaves_no_worker(repository, make_server):
    from tests.server_helpers import stop_server

    before = set(worker_pids())
    server = make_server(repository)
    assert set(worker_pids()) - before
    stop_server(server)
    deadline = time.monotonic() + 30
    while set(worker_pids()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(worker_pids()) - before


def test_a_multi_node_llm_serves_with_a_worker_node_started_apart(tmp_path, make_server):
    """nnodes 2 on one machine: tritonserver's llm is node 0 (rank 0); rank 1 is run by the
    worker-node entry point, started separately with a worker pod's environment, on the same
    model directory. Same text as the single-device model; stopping the server ends the node."""
    import subprocess
    import sys

    from tests.server_helpers import stop_server
    from tooling.tritonserver import free_port

    port = free_port()
    common = {"model": str(SHAKESPEARE), "dtype": "float32", "cpu_kv_cache_gb": "0.05"}
    sharded = {"tensor_parallel_size": "2", "nnodes": "2", "master_port": str(port)}
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
