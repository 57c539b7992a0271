"""A/B traffic between two versions of `llm` through real servers: tritonserver with both versions
(different checkpoints, so each answer shows which version computed it) and the OpenAI frontend
with a 90/10 split. The split lands on its weights over 2,000 requests, sticky keys and pinned ids
reach their versions, a split changed under 16 streams drops none of them, and unloading version 2
sends its share to version 1 without a failed request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import tritonclient.http as httpclient

from backend_lib.metrics import parse_prometheus_text
from tests.e2e.llm_helpers import shakespeare_and_tiny_llama

pytestmark = pytest.mark.e2e

ADMIN_KEY = "ab-admin"
ONE_TOKEN = {"prompt": "ROMEO:", "max_tokens": 1, "temperature": 0}
REQUESTS = 2000


@pytest.fixture
def two_versions(tmp_path: Path) -> Path:
    return shakespeare_and_tiny_llama(tmp_path, max_num_seqs="16")


async def _completions(url: str, bodies: list[dict], headers: list[dict], width: int = 32):
    limit = asyncio.Semaphore(width)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(body, header):
            async with limit:
                return await http.post("/v1/completions", json=body, headers=header)

        return await asyncio.gather(*(one(b, h) for b, h in zip(bodies, headers, strict=True)))


async def _streams(url: str, count: int, during) -> list[list[str]]:
    """`count` concurrent streamed completions; `during()` runs once all have begun."""
    body = {
        "model": "llm",
        "prompt": "ROMEO:",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    started = asyncio.Event()
    begun = 0

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(i):
            nonlocal begun
            events = []
            headers = {"x-ab-key": f"stream-{i}"}
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            begun += 1
                            if begun == count:
                                started.set()
            return events

        async def change():
            await started.wait()
            await asyncio.to_thread(during)

        *events, _ = await asyncio.gather(*(one(i) for i in range(count)), change())
        return events


def test_split_pinned_sticky_changed_and_unloaded(two_versions, make_server, make_frontend):
    server = make_server(two_versions, ["--model-control-mode=explicit", "--load-model=llm"])
    frontend = make_frontend(
        server.grpc_url,
        two_versions,
        "--index-ttl",
        "0.5",
        "--traffic-split",
        "llm=1:90,2:10",
        "--triton-admin-key",
        ADMIN_KEY,
    )
    triton = httpclient.InferenceServerClient(server.http_url)
    http = httpx.Client(base_url=frontend.url, timeout=120)

    # Pinned ids reach their version: the two checkpoints answer differently.
    answers = {}
    for version in ("1", "2"):
        reply = http.post("/v1/completions", json={**ONE_TOKEN, "model": f"llm:{version}"})
        assert reply.status_code == 200 and reply.headers["x-model-version"] == version
        answers[version] = reply.json()["choices"][0]["text"]
    assert answers["1"] != answers["2"]

    # 2,000 keyed requests: within 3 points of 90/10, each answer from the version it names.
    keys = [f"user-{i}" for i in range(REQUESTS)]
    replies = asyncio.run(
        _completions(
            frontend.url,
            [{**ONE_TOKEN, "model": "llm"}] * REQUESTS,
            [{"x-ab-key": k} for k in keys],
        )
    )
    assert {r.status_code for r in replies} == {200}
    chosen = {k: r.headers["x-model-version"] for k, r in zip(keys, replies, strict=True)}
    for reply in replies:
        version = reply.headers["x-model-version"]
        assert reply.json()["model"] == f"llm:{version}"
        assert reply.json()["choices"][0]["text"] == answers[version]
    share = Counter(chosen.values())["2"] / REQUESTS
    assert abs(share - 0.10) <= 0.03, share
    # Sticky: the same keys again (and through `user`) reach the same versions.
    again = asyncio.run(
        _completions(
            frontend.url,
            [{**ONE_TOKEN, "model": "llm", "user": k} for k in keys[:300]],
            [{}] * 300,
        )
    )
    assert [r.headers["x-model-version"] for r in again] == [chosen[k] for k in keys[:300]]
    # Triton counted the same split: its per-version success counters grew by what we saw.
    samples = parse_prometheus_text(server.metrics_text())
    success = {
        dict(labels)["version"]: value
        for (name, labels), value in samples.items()
        if name.startswith("nv_inference_request_success") and dict(labels).get("model") == "llm"
    }
    assert success["2"] >= Counter(chosen.values())["2"]

    # Changing the split under 16 concurrent streams drops none of them.
    def set_split():
        reply = httpx.put(
            f"{frontend.url}/admin/traffic-splits/llm",
            json={"weights": {"1": 50, "2": 50}},
            headers={"x-admin-key": ADMIN_KEY},
        )
        assert reply.status_code == 200, reply.text

    streams = asyncio.run(_streams(frontend.url, 16, set_split))
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert http.get("/admin/traffic-splits", headers={"x-admin-key": ADMIN_KEY}).json() == {
        "splits": {"llm": {"1": 50, "2": 50}}
    }

    # Unloading version 2 under traffic: its share goes to version 1, no request fails.
    failures: list[str] = []
    served: Counter[str] = Counter()
    stop = threading.Event()

    def traffic():
        with httpx.Client(base_url=frontend.url, timeout=120) as client:
            while not stop.is_set():
                reply = client.post("/v1/completions", json={**ONE_TOKEN, "model": "llm"})
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code} {reply.text}")
                else:
                    served[reply.headers["x-model-version"]] += 1

    workers = [threading.Thread(target=traffic) for _ in range(4)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1.0)
        config = triton.get_model_config("llm")
        triton.load_model(
            "llm", config=json.dumps({**config, "version_policy": {"specific": {"versions": [1]}}})
        )
        assert not triton.is_model_ready("llm", "2")
        before = served["1"]
        time.sleep(2.0)
        assert served["1"] > before
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
    assert not failures, failures[:3]
    metrics = http.get("/metrics").text
    rerouted = [
        line
        for line in metrics.splitlines()
        if line.startswith("openai_frontend_split_rerouted_total") and 'version="2"' in line
    ]
    assert rerouted and float(rerouted[0].rsplit(" ", 1)[1]) > 0
    http.close()
