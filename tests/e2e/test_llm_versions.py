"""Versioning: two versions of `llm` (different checkpoints) served side by side, routed by version,
labelled by version on the metrics; under explicit model control one version is unloaded and loaded
again while the other serves traffic without a failed request."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_client import http_generate
from tests.e2e.llm_helpers import shakespeare_and_tiny_llama

pytestmark = pytest.mark.e2e

GREEDY = json.dumps({"temperature": 0, "max_tokens": 8, "ignore_eos": True})


def generate(server, version: str, prompt: str = "ROMEO:") -> str:
    body = {"text_input": prompt, "sampling_parameters": GREEDY, "exclude_input_in_output": True}
    return http_generate(server.http_url, body, version=version)["text_output"]


@pytest.fixture
def two_version_repository(tmp_path: Path) -> Path:
    return shakespeare_and_tiny_llama(tmp_path)


def test_two_versions_side_by_side_and_reload_one_under_traffic(
    two_version_repository, make_server
):
    server = make_server(
        two_version_repository, ["--model-control-mode=explicit", "--load-model=llm"]
    )
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("llm", "1") and client.is_model_ready("llm", "2")
    v1, v2 = generate(server, "1"), generate(server, "2")
    assert v1 != v2  # different checkpoints answer differently
    assert generate(server, "") == v2  # no version: the latest

    samples = parse_prometheus_text(server.metrics_text())
    versions = {
        dict(labels).get("version")
        for (name, labels) in samples
        if name == "vllm:generation_tokens_total" and dict(labels).get("model") == "llm"
    }
    assert versions == {"1", "2"}

    failures: list[str] = []
    served = 0
    stop = threading.Event()

    def traffic():
        nonlocal served
        while not stop.is_set():
            try:
                if generate(server, "1") != v1:
                    failures.append("version 1 answered differently")
                served += 1
            except Exception as exc:  # every failure is a test failure
                failures.append(repr(exc))

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        config = client.get_model_config("llm")
        only_v1 = {**config, "version_policy": {"specific": {"versions": [1]}}}
        client.load_model("llm", config=json.dumps(only_v1))
        assert not client.is_model_ready("llm", "2")
        with pytest.raises(urllib.error.HTTPError):
            generate(server, "2")
        client.load_model("llm", config=json.dumps({**config, "version_policy": {"all": {}}}))
        assert client.is_model_ready("llm", "2")
        assert generate(server, "2") == v2
        time.sleep(1.0)
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not failures, failures[:3]
    assert served > 0
