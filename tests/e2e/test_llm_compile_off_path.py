"""End to end: constraints that cost seconds to compile hold up no other request of a real
tritonserver. Their compiles run in worker processes of the llm's stub, while Triton's execute
thread goes on submitting and the engine goes on stepping: free requests sent beside three such
requests keep their latency, and the three finish with outputs their schema allows."""

from __future__ import annotations

import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.llm_client import grpc_stream
from tests.e2e.llm_helpers import GREEDY, assert_engine_idle
from tests.llm.structured.compile_helpers import SLOW_N, costly_schema

pytestmark = pytest.mark.e2e

FREE = {**GREEDY, "max_tokens": 24, "ignore_eos": True}
FREE_REQUESTS = 4


def _free_batch(pool: ThreadPoolExecutor, url: str) -> float:
    started = time.perf_counter()
    results = list(pool.map(lambda i: grpc_stream(url, f"ROMEO {i}:", FREE), range(FREE_REQUESTS)))
    assert all(r.error is None for r in results)
    return time.perf_counter() - started


def test_free_requests_keep_their_latency_beside_costly_compiles(server):
    url = server.grpc_url
    with ThreadPoolExecutor(FREE_REQUESTS + 3) as pool:
        warm = grpc_stream(url, "KING:", {**GREEDY, "structured_outputs": {"regex": "[ab]{2}"}})
        assert warm.error is None and re.fullmatch("[ab]{2}", warm.text)  # workers started
        _free_batch(pool, url)
        alone = [_free_batch(pool, url) for _ in range(3)]
        schemas = [costly_schema(SLOW_N) for _ in range(3)]
        costly = [
            pool.submit(
                grpc_stream,
                url,
                "KING:",
                {**GREEDY, "max_tokens": 16, "structured_outputs": {"json": schema}},
            )
            for schema in schemas
        ]
        time.sleep(0.2)  # the three were submitted and wait for their grammars
        # Several samples: a neighbour's load (another test worker) only ever adds time, so the
        # quickest batch beside the compiles is the fair one to compare.
        during = [_free_batch(pool, url) for _ in range(3)]
        still_compiling = sum(not future.done() for future in costly)
        results = [future.result() for future in costly]
    assert still_compiling >= 1
    assert min(during) < 2 * statistics.median(alone), (during, alone)
    for schema, result in zip(schemas, results, strict=True):
        assert result.error is None, result.error
        if result.text.endswith('"') and len(result.text) > 1:
            assert re.fullmatch(schema["pattern"], json.loads(result.text))
    assert_engine_idle(server)
