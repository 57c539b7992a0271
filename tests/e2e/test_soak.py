"""Soak: mixed traffic on all models for `--soak-seconds` (default 60): greedy requests checked
against reference texts, randomly sampled ones, cancelled streams, bursts that overflow llm_small's
queue, malformed requests from the table, embedding and rerank calls. Afterwards every request has
ended (per-request timeouts: none stuck), the engines are idle, the server is healthy and the stubs
have not grown threads. Longer: `pytest tests/e2e/test_soak.py --soak-seconds 600`."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.malformed_requests import CASES, send
from tests.e2e.reliability_helpers import (
    GREEDY,
    PROMPTS,
    REQUEST_TIMEOUT,
    Outcome,
    Reference,
    check_encoders,
    compute_reference,
    grpc_request,
    http_generate_request,
    http_stream_request,
    proc_status,
    stub_pid,
    wait_engine_idle,
)

pytestmark = pytest.mark.e2e

WORKERS = 4
LLM_MODELS = ("llm", "llm_small")
STUB_MODELS = (*LLM_MODELS, "embedding", "rerank")
THREAD_SLACK = 2
"""Threads a stub may gain over the soak (Python's and torch's own lazily started workers); each
request's responder thread must be gone."""
ACTIONS = {"greedy": 5, "sampled": 4, "cancel": 3, "burst": 1, "bad": 2, "encoders": 2}
"""Relative frequency of each kind of traffic."""


class Soak:
    """Shared state of the soak workers: counts by outcome, and problems (a wrong answer, an
    unexpected error, a stuck request)."""

    def __init__(self, server, reference: Reference, deadline: float):
        self.server, self.reference, self.deadline = server, reference, deadline
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self._lock = threading.Lock()

    def record(self, kind: str, problem: str | None = None) -> None:
        with self._lock:
            self.counts["sent"] += 1
            self.counts[kind] += 1
            if problem:
                self.problems.append(problem)

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
            try:
                getattr(self, action)(rng)
            except Exception as exc:  # a client-side surprise is a problem too
                self.record("errored", f"{action} raised {type(exc).__name__}: {exc}")

    def llm_request(
        self,
        rng: random.Random,
        model: str,
        prompt: str,
        params: dict,
        cancel_after: int | None = None,
    ) -> Outcome:
        url = self.server.http_url, self.server.grpc_url
        choice = rng.randrange(3) if cancel_after is None else rng.randrange(2)
        if choice == 0:
            return grpc_request(url[1], model, prompt, params, cancel_after)
        if choice == 1:
            return http_stream_request(url[0], model, prompt, params, cancel_after)
        return http_generate_request(url[0], model, prompt, params)

    def check(
        self, outcome: Outcome, what: str, expected_text: str | None = None, may_refuse: bool = True
    ) -> None:
        problem = None
        if outcome.kind in ("errored", "stuck") or (outcome.kind == "refused" and not may_refuse):
            problem = f"{what}: {outcome.kind} {outcome.error}"
        elif (
            outcome.kind == "completed"
            and expected_text is not None
            and outcome.text != expected_text
        ):
            problem = f"{what}: {outcome.text!r} != {expected_text!r}"
        self.record(outcome.kind, problem)

    def greedy(self, rng: random.Random) -> None:
        model, prompt = rng.choice(LLM_MODELS), rng.choice(PROMPTS)
        outcome = self.llm_request(rng, model, prompt, GREEDY)
        self.check(
            outcome,
            f"greedy {model} {prompt!r}",
            self.reference.texts[model][prompt],
            may_refuse=model == "llm_small",
        )

    def sampled(self, rng: random.Random) -> None:
        params = {
            "temperature": rng.uniform(0.3, 1.5),
            "top_p": rng.uniform(0.3, 1.0),
            "top_k": rng.choice([-1, 1, 5, 40]),
            "min_p": rng.choice([0.0, 0.05]),
            "max_tokens": rng.randint(1, 40),
            "n": rng.choice([1, 1, 2]),
            "presence_penalty": rng.uniform(-1, 1),
            "frequency_penalty": rng.uniform(-1, 1),
            "repetition_penalty": rng.uniform(0.8, 1.3),
            "stop": rng.choice([[], ["\n\n"]]),
        }
        if rng.random() < 0.5:
            params["seed"] = rng.randrange(2**32)
        model = rng.choice(LLM_MODELS)
        outcome = self.llm_request(rng, model, rng.choice(PROMPTS), params)
        self.check(outcome, f"sampled {model} {params}", may_refuse=model == "llm_small")

    def cancel(self, rng: random.Random) -> None:
        """A stream the client cancels (gRPC) or drops (HTTP) after 0-6 responses; on llm_small
        it may still be waiting in the queue then."""
        params = {**GREEDY, "max_tokens": 64}
        model = rng.choice(LLM_MODELS)
        outcome = self.llm_request(
            rng, model, rng.choice(PROMPTS), params, cancel_after=rng.randint(0, 6)
        )
        self.check(outcome, f"cancelled stream {model}", may_refuse=model == "llm_small")

    def burst(self, rng: random.Random) -> None:
        """More concurrent streams than llm_small holds (4 running + 8 queued): some are refused."""
        prompts = [rng.choice(PROMPTS) for _ in range(16)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            outcomes = list(
                pool.map(
                    lambda p: grpc_request(self.server.grpc_url, "llm_small", p, GREEDY), prompts
                )
            )
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            self.check(outcome, f"burst {prompt!r}", self.reference.texts["llm_small"][prompt])

    def bad(self, rng: random.Random) -> None:
        case = rng.choice(CASES)
        message = send(case, self.server.http_url, self.server.grpc_url)
        ok = message is not None and case.expected in message
        self.record("errored", None if ok else f"bad request {case.id}: {message!r}")

    def encoders(self, rng: random.Random) -> None:
        """One embedding and one rerank request."""
        problems = check_encoders(self.server, self.reference)
        self.record("completed", "; ".join(problems) or None)
        self.record("completed")


def stub_threads(server) -> dict[str, int]:
    return {model: proc_status(stub_pid(server, model), "Threads") for model in STUB_MODELS}


def test_soak_mixed_traffic_ends_clean(reliability_server, request):
    seconds = request.config.getoption("--soak-seconds")
    server = reliability_server
    reference = compute_reference(server, LLM_MODELS)
    threads_before = stub_threads(server)
    soak = Soak(server, reference, time.monotonic() + seconds)
    workers = [
        threading.Thread(target=soak.worker, args=(seed,), daemon=True) for seed in range(WORKERS)
    ]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:  # each request has its own timeout, so the workers must end
        worker.join(timeout=seconds + 4 * REQUEST_TIMEOUT)
    elapsed = time.monotonic() - started
    gauges = {model: wait_engine_idle(server, model) for model in LLM_MODELS}
    threads_after = stub_threads(server)

    counts = soak.counts
    print(
        f"\n[soak] {elapsed:.0f} s, {WORKERS} workers: sent={counts['sent']} "
        + " ".join(
            f"{k}={counts[k]}" for k in ("completed", "refused", "errored", "cancelled", "stuck")
        )
        + f" problems={len(soak.problems)}"
    )
    print(f"[soak] stub threads before {threads_before} after {threads_after}; gauges {gauges}")
    assert not any(worker.is_alive() for worker in workers), "a soak worker is stuck"
    assert soak.problems == []
    assert counts["stuck"] == 0 and counts["completed"] > 0 and counts["cancelled"] > 0
    assert all(not any(values.values()) for values in gauges.values()), gauges
    assert server.is_alive() and server.is_ready()
    for model, before in threads_before.items():
        assert threads_after[model] <= before + THREAD_SLACK, (model, before, threads_after[model])
    for model in LLM_MODELS:  # greedy answers are still the reference's
        outcome = grpc_request(server.grpc_url, model, PROMPTS[0], GREEDY)
        assert (outcome.kind, outcome.text) == ("completed", reference.texts[model][PROMPTS[0]])
