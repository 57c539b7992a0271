"""`make serve`'s script: prints how to call each model, serves the repository, and restricts the
repository-control API to the admin key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tooling.repository import REPO_ROOT
from tooling.tritonserver import free_ports
from tooling.tritonserver import http_status as status

pytestmark = pytest.mark.e2e


def test_serve_prints_usage_and_restricts_repository_control(tmp_path):
    http, grpc, metrics, openai_port = free_ports(4)
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "serve.py"),
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            f"--openai-port={openai_port}",
        ],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "TRITON_ADMIN_KEY": "test-key"},
    )
    try:
        deadline = time.monotonic() + 300
        while status(f"http://127.0.0.1:{http}/v2/health/ready") != 200:
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            time.sleep(0.5)
        index = f"http://127.0.0.1:{http}/v2/repository/index"
        assert status(index, "POST") == 403
        assert status(index, "POST", {"triton-admin-key": "wrong"}) == 403
        assert status(index, "POST", {"triton-admin-key": "test-key"}) == 200
        output = (tmp_path / "serve.log").read_text()
        for model in ("embedding", "rerank", "llm"):
            assert f"/v2/models/{model}/" in output
        assert "test-key" not in output  # the key is never printed
        assert f"localhost:{openai_port}/v1/chat/completions" in output
        # The OpenAI frontend answers too, listing the models (its index read needs the key).
        models_url = f"http://127.0.0.1:{openai_port}/v1/models"
        while status(models_url) != 200:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        with urllib.request.urlopen(models_url, timeout=10) as response:
            listed = {m["id"] for m in json.load(response)["data"]}
        adapters = json.loads((REPO_ROOT / "model_repository/llm/1/multi_lora.json").read_text())
        # The llm's LoRA adapters too, and each model's version pinned.
        assert listed == {
            "embedding",
            "rerank",
            "llm",
            *adapters,
            "embedding:1",
            "rerank:1",
            "llm:1",
        }
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
