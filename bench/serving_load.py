"""The served-LLM benchmark's load: prompts, closed-loop and Poisson clients of tritonserver
(tritonclient.grpc.aio, one decoupled `stream_infer` per request), the same closed loop on the
engine in this process, and each request's timings (`RequestTiming`, per run `Run`)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from bench.llm import greedy
from bench.timing import percentile

T = TypeVar("T")


# --- workload and per-request figures ------------------------------------------------------------


def make_prompts(count: int, prompt_len: tuple[int, int], vocab: int, key: str) -> list[str]:
    """`count` prompts of seeded random length, each word one token of the word-level tokenizer."""
    rng = random.Random(key)
    return [
        " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(*prompt_len)))
        for _ in range(count)
    ]


@dataclass
class RequestTiming:
    """perf_counter seconds of one request, and what it produced."""

    sent: float
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    text: str = ""

    def on_tokens(self, count: int, now: float) -> None:
        if count and self.first_token is None:
            self.first_token = now
        self.output_tokens += count


@dataclass
class Run:
    """One timed run of one system under one load."""

    system: str
    """served or direct."""
    load: str
    """closed (fixed concurrency) or poisson."""
    concurrency: int | None
    rate: float | None
    repeat: int
    requests: list[RequestTiming] = field(default_factory=list)

    def per_request(self) -> dict[str, list[float]]:
        ttft = [r.first_token - r.sent for r in self.requests]
        e2e = [r.end - r.sent for r in self.requests]
        itl = [
            (e - t) / (r.output_tokens - 1)
            for r, t, e in zip(self.requests, ttft, e2e, strict=True)
            if r.output_tokens > 1
        ]
        return {"ttft_s": ttft, "itl_s": itl, "e2e_s": e2e}

    def metrics(self) -> dict[str, float | None]:
        values = self.per_request()
        seconds = max(r.end for r in self.requests) - min(r.sent for r in self.requests)
        out: dict[str, float | None] = {
            "seconds": seconds,
            "output_tokens_per_s": sum(r.output_tokens for r in self.requests) / seconds,
            "requests_per_s": len(self.requests) / seconds,
        }
        for name, series in values.items():
            for q in (50, 99):
                out[f"{name.removesuffix('_s')}_p{q}_s"] = percentile(series, q) if series else None
        return out

    def record(self) -> dict:
        return {
            "system": self.system,
            "load": self.load,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "repeat": self.repeat,
            "metrics": self.metrics(),
            "per_request": self.per_request(),
        }


# --- served: asyncio gRPC streaming clients ------------------------------------------------------


def llm_stream_inputs(
    prompt: str, params: dict, flags: tuple[str, ...] = ("return_num_output_tokens",)
) -> list:
    """The llm's gRPC inputs for one streamed request: the prompt, `sampling_parameters`, and the
    `return_*` flags set (num_output_tokens is what the timing counts)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value) -> object:
        array = np.array([value], dtype=object if isinstance(value, bytes) else bool)
        item = grpcclient.InferInput(name, [1], "BYTES" if isinstance(value, bytes) else "BOOL")
        item.set_data_from_numpy(array)
        return item

    return [
        tensor("text_input", prompt.encode()),
        tensor("stream", True),
        tensor("sampling_parameters", json.dumps(params).encode()),
        tensor("exclude_input_in_output", True),
        *(tensor(flag, True) for flag in flags),
    ]


async def stream_request(client, inputs: list) -> RequestTiming:
    """One streamed llm request over gRPC; token counts come from the server's num_output_tokens."""

    async def one_request():
        yield {"model_name": "llm", "inputs": inputs}

    timing = RequestTiming(time.perf_counter())
    pieces = []
    async for result, error in client.stream_infer(one_request()):
        now = time.perf_counter()
        if error is not None:
            raise RuntimeError(f"served request failed: {error}")
        pieces.append(b"".join(result.as_numpy("text_output")).decode())
        timing.on_tokens(int(result.as_numpy("num_output_tokens").sum()), now)
        if result.get_response().parameters["triton_final_response"].bool_param:
            timing.end = now
    timing.text = "".join(pieces)
    if timing.end is None:
        raise RuntimeError("the response stream ended without a final response")
    return timing


async def served_request(client, prompt: str, max_tokens: int) -> RequestTiming:
    """One streamed greedy request of exactly `max_tokens` tokens."""
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return await stream_request(client, llm_stream_inputs(prompt, params))


async def _closed_loop(
    url: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    import tritonclient.grpc.aio as aioclient

    client = aioclient.InferenceServerClient(url)
    results: list[RequestTiming | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def client_loop() -> None:
        for i in next_index:  # shared iterator: each client takes the next prompt when free
            results[i] = await served_request(client, prompts[i], max_tokens)

    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        await client.close()
    return results


async def _poisson(
    url: str, prompts: list[str], max_tokens: int, rate: float, key: str
) -> list[RequestTiming]:
    import tritonclient.grpc.aio as aioclient

    rng = random.Random(key)
    client = aioclient.InferenceServerClient(url)
    start, arrival, tasks = time.perf_counter(), 0.0, []
    try:
        for prompt in prompts:
            await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(served_request(client, prompt, max_tokens)))
            arrival += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


def served_closed_loop(
    url: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    return asyncio.run(_closed_loop(url, prompts, max_tokens, concurrency))


def served_poisson(
    url: str, prompts: list[str], max_tokens: int, rate: float, key: str
) -> list[RequestTiming]:
    return asyncio.run(_poisson(url, prompts, max_tokens, rate, key))


# --- direct: the engine's step loop in this process ----------------------------------------------


def on_worker_thread(function: Callable[[], T]) -> T:
    """Run `function` on a new thread and return its result.

    The server steps its engine on a background thread (EngineLoop), and torch's CPU parallelism
    is not the same there as on a process's main thread (measured at 2 threads: ~2 busy CPUs on
    the main thread, ~1.2 on another), so the direct engine runs on a thread of its own too.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # re-raised in the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="direct-engine")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def direct_closed_loop(
    engine, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    """Keep `concurrency` requests in the engine, adding the next one as each finishes (on a
    worker thread, as the server runs its engine)."""
    return on_worker_thread(lambda: _direct_closed_loop(engine, prompts, max_tokens, concurrency))


def _direct_closed_loop(
    engine, prompts: list[str], max_tokens: int, concurrency: int
) -> list[RequestTiming]:
    params = greedy(max_tokens)
    results: dict[str, RequestTiming] = {}
    order: list[str] = []
    waiting = iter(prompts)

    def submit_next() -> None:
        prompt = next(waiting, None)
        if prompt is not None:
            request_id = f"direct-{time.perf_counter_ns()}-{len(order)}"
            results[request_id] = RequestTiming(time.perf_counter())
            order.append(request_id)
            engine.add_request(request_id, prompt, params)

    for _ in range(concurrency):
        submit_next()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timing = results[out.request_id]
            completion = out.outputs[0]
            timing.on_tokens(len(completion.token_ids) - timing.output_tokens, now)
            if out.finished:
                timing.end, timing.text = now, completion.text
                submit_next()
    return [results[r] for r in order]
