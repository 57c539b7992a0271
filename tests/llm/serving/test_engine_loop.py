"""EngineLoop: the background thread model.py talks to. Streams from concurrent submitters
against `transformers` greedy outputs, abort mid-stream, synchronous input errors, queue limit,
fault isolation, the stats hook, and shutdown."""

from __future__ import annotations

import itertools
import queue
import threading

import pytest

from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.stats import EngineStats
from backend_lib.llm.serving.engine_loop import EngineLoop
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    random_prompt,
)
from tests.llm.serving.engine_loop_helpers import TIMEOUT, collect
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _hold_after_first_step(event: threading.Event):
    """A fault_injector that lets the first step through, then holds each step until `event`
    (so the request cannot finish before the test acts)."""
    calls = itertools.count()
    return lambda request_id: next(calls) == 0 or event.wait(TIMEOUT)


def test_concurrent_submitters_get_their_own_correct_streams():
    model_dir, hf = engine_checkpoint("Qwen2ForCausalLM")
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    observed: list[EngineStats] = []
    loop = EngineLoop(engine, on_step=observed.append)
    loop.start()
    prompts = {
        f"t{t}-r{r}": random_prompt(4 + 3 * t + r, 10 * t + r) for t in range(4) for r in range(2)
    }
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def client(thread_index: int) -> None:
        try:
            streams = {
                rid: loop.submit(EngineRequest(rid, None, greedy(6), prompt_token_ids=prompt))
                for rid, prompt in prompts.items()
                if rid.startswith(f"t{thread_index}-")
            }
            for rid, stream in streams.items():
                results[rid] = list(stream)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    loop.stop()
    assert not errors and set(results) == set(prompts)
    for rid, outputs in results.items():
        final = outputs[-1].outputs[0]
        assert all(o.request_id == rid for o in outputs) and outputs[-1].finished
        assert not any(o.finished for o in outputs[:-1])
        assert final.token_ids == hf_greedy(hf, prompts[rid], 6)
        assert sum((o.outputs[0].delta_token_ids for o in outputs), []) == final.token_ids
        assert "".join(o.outputs[0].delta_text for o in outputs) == final.text
    assert observed and observed[-1].counters.requests_finished == len(prompts)
    assert sum(len(s.finished) for s in observed) == len(prompts)
    assert_pool_released(engine)


def test_abort_mid_stream_frees_blocks_and_unknown_ids_are_ignored():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    aborted = threading.Event()
    engine.fault_injector = _hold_after_first_step(aborted)
    loop = EngineLoop(engine)
    loop.start()
    stream = loop.submit(
        EngineRequest("long", None, greedy(100), prompt_token_ids=random_prompt(10, 1))
    )
    first = stream.get(timeout=TIMEOUT)
    assert not first.finished and first.outputs[0].token_ids
    loop.abort("long")
    aborted.set()
    loop.abort("never-submitted")
    rest = collect(stream)
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < 100
    loop.abort("long")  # finished: a no-op
    after = loop.submit(
        EngineRequest("after", None, greedy(3), prompt_token_ids=random_prompt(5, 2))
    )
    assert collect(after)[-1].outputs[0].finish_reason == "length"
    loop.stop()
    assert_pool_released(engine)


def test_bad_input_raises_in_the_callers_thread():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    loop = EngineLoop(make_engine(model_dir))
    with pytest.raises(InputError, match="empty"):
        loop.submit(EngineRequest("empty", "", greedy(4)))
    with pytest.raises(InputError, match="max_model_len"):
        loop.submit(EngineRequest("long", None, greedy(4), prompt_token_ids=random_prompt(128, 3)))
    with pytest.raises(InputError, match="logprobs"):
        loop.submit(EngineRequest("lp", "ka", SamplingParams(logprobs=1000)))
    # Before start, so "ok" cannot finish (and free its id) before the duplicate arrives.
    stream = loop.submit(EngineRequest("ok", "ka ro", greedy(2)))
    with pytest.raises(InputError, match="already"):
        loop.submit(EngineRequest("ok", "ka ro", greedy(2)))
    loop.start()
    assert collect(stream)[-1].error is None
    loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(EngineRequest("late", "ka", greedy(2)))


def test_queue_limit_is_enforced_at_submit_and_stop_closes_every_stream():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_queue_size=3)
    loop = EngineLoop(engine)  # not started: nothing drains the queue
    streams = [loop.submit(EngineRequest(f"r{i}", "ka", greedy(4))) for i in range(3)]
    with pytest.raises(QueueFullError):
        loop.submit(EngineRequest("r3", "ka", greedy(4)))
    with pytest.raises(queue.Empty):
        streams[0].get(timeout=0.05)
    loop.stop()
    for stream in streams:
        (final,) = collect(stream)
        assert final.finished and final.outputs[0].finish_reason == "abort"
    assert_pool_released(engine)


def test_fault_in_one_request_fails_only_its_stream():
    model_dir, hf = engine_checkpoint("MistralForCausalLM")
    engine = make_engine(model_dir)

    def injector(request_id: str) -> None:
        if request_id == "bad":
            raise ValueError("broken detokenizer")

    engine.fault_injector = injector
    loop = EngineLoop(engine)
    loop.start()
    prompts = {"good": random_prompt(9, 4), "bad": random_prompt(9, 5)}
    streams = {
        rid: loop.submit(EngineRequest(rid, None, greedy(5), prompt_token_ids=p))
        for rid, p in prompts.items()
    }
    bad, good = collect(streams["bad"])[-1], collect(streams["good"])[-1]
    assert bad.error == "ValueError: broken detokenizer"
    assert bad.outputs[0].finish_reason == "error"
    assert good.error is None and good.outputs[0].token_ids == hf_greedy(hf, prompts["good"], 5)
    loop.stop()
    assert_pool_released(engine)


def test_stop_aborts_running_requests():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    stopping = threading.Event()
    engine.fault_injector = _hold_after_first_step(stopping)
    loop = EngineLoop(engine)
    loop.start()
    stream = loop.submit(
        EngineRequest("long", None, greedy(100), prompt_token_ids=random_prompt(6, 6))
    )
    stream.get(timeout=TIMEOUT)
    threading.Timer(0.05, stopping.set).start()  # lets the step in flight end after stop()
    loop.stop(timeout=TIMEOUT)
    assert collect(stream)[-1].outputs[0].finish_reason == "abort"
    assert_pool_released(engine)


def test_unexpected_engine_error_fails_open_streams_and_loop_keeps_serving():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    real_step, calls = engine.step, itertools.count()

    def buggy_step():
        if next(calls) == 1:
            raise RuntimeError("engine bug")
        return real_step()

    engine.step = buggy_step
    loop = EngineLoop(engine)
    loop.start()
    final = collect(
        loop.submit(EngineRequest("a", None, greedy(5), prompt_token_ids=random_prompt(7, 7)))
    )[-1]
    assert final.error == "engine failure: RuntimeError: engine bug"
    assert final.outputs[0].finish_reason == "error"
    prompt = random_prompt(8, 8)
    final = collect(loop.submit(EngineRequest("b", None, greedy(4), prompt_token_ids=prompt)))[-1]
    assert final.error is None and final.outputs[0].token_ids == hf_greedy(hf, prompt, 4)
    loop.stop()
    assert_pool_released(engine)
