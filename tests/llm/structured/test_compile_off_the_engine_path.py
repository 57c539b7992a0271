"""Grammar compilation off the engine's path: constraints compile in worker processes, a request
whose grammar is not ready waits outside the scheduler (no batch slot, no KV block, counted in
the queue) while the step loop keeps serving the others, identical constraints compile once, a
compile past the model's timeout fails that request alone and its worker is killed, a worker
that dies fails only its constraint and is replaced, compile errors found late are still input
errors, and no worker outlives its engine or its process."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import transformers
import xgrammar as xgr

from backend_lib.contract import ErrorCode
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.serving import engine_loop as engine_loop_module
from backend_lib.llm.serving.engine_loop import EngineLoop
from backend_lib.llm.structured.compile_worker import CompileError, CompileWorkers
from tests.llm.engine_helpers import assert_pool_released, make_engine
from tests.llm.serving.engine_loop_helpers import collect
from tests.llm.structured.compile_helpers import (
    STUCK_N,
    costly_pattern,
    costly_schema,
    process_gone,
)
from tests.llm.structured.structured_helpers import REGEX, byte_level_checkpoint

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = "ROMEO:\nWhat say you?"
FREE_TOKENS = 16


def free(max_tokens: int = FREE_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def constrained(schema: dict, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": schema}
    )


def shakespeare_engine(**overrides):
    model_dir, _ = byte_level_checkpoint("shakespeare")
    settings = {"max_model_len": 96, "num_blocks": 256, "max_num_seqs": 16, **overrides}
    return make_engine(model_dir, **settings)


def warm_workers(engine) -> None:
    """Start the engine's compile workers (a cheap constraint compiled through them) and wait
    until all of them are ready."""
    engine.prepare_request(EngineRequest("warm", "KING:", constrained({"type": "integer"})))
    workers = engine.grammar_compiler.workers
    deadline = time.monotonic() + 120
    while workers.num_ready < workers.max_workers and time.monotonic() < deadline:
        time.sleep(0.05)


def held_request(engine, request_id: str, schema: dict):
    """Prepare (not waiting for the grammar) and add: the request is held while it compiles."""
    prepared = engine.prepare_request(
        EngineRequest(request_id, PROMPT, constrained(schema)), grammar_wait=0
    )
    assert prepared.grammar_job is not None and not prepared.grammar_job.done()
    engine.add_prepared(prepared)
    return prepared.grammar_job


def check_pattern_output(text: str, schema: dict) -> None:
    """A finished output of a costly schema: a JSON string matching its pattern."""
    value = json.loads(text)
    assert re.fullmatch(schema["pattern"], value)


def test_steps_go_on_while_a_grammar_compiles_and_the_request_joins_when_it_is_ready():
    engine = shakespeare_engine()
    warm_workers(engine)
    schema = costly_schema()
    job = held_request(engine, "costly", schema)
    engine.add_request("free", PROMPT, free())
    assert engine.num_held == 1 and engine.stats().num_waiting_for_grammar == 1
    assert engine.stats().num_waiting == 2  # held requests count as waiting
    steps_while_compiling, finals = 0, {}
    while "free" not in finals:
        compiling = not job.done()
        outputs = engine.step()
        steps_while_compiling += compiling
        finals.update((o.request_id, o) for o in outputs if o.finished)
    assert finals["free"].error is None
    assert len(finals["free"].outputs[0].token_ids) == FREE_TOKENS
    # The free request ran to its end while the compile was still running, and the held
    # request took no slot and no KV block meanwhile.
    assert not job.done() and steps_while_compiling >= FREE_TOKENS
    assert engine.scheduler.kv_cache_manager.pool.num_free_blocks == engine.runner.num_blocks
    assert not engine.needs_step()  # nothing to step: the loop would sleep, not spin
    job.wait(60)
    assert engine.needs_step()
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    costly = finals["costly"]
    assert costly.error is None, costly.error
    if costly.outputs[0].finish_reason == "stop":
        check_pattern_output(costly.outputs[0].text, schema)
    assert engine.num_held == 0
    assert len(engine.structured) == 0
    assert_pool_released(engine)


def _free_latency(loop: EngineLoop, tag: str, count: int = 4) -> float:
    """Seconds until `count` free requests submitted together all finished."""
    started = time.perf_counter()
    streams = [loop.submit(EngineRequest(f"{tag}-{i}", PROMPT, free())) for i in range(count)]
    for stream in streams:
        final = collect(stream)[-1]
        assert final.error is None and len(final.outputs[0].token_ids) == FREE_TOKENS
    return time.perf_counter() - started


def test_free_requests_beside_three_costly_compiles_keep_their_latency():
    engine = shakespeare_engine()
    steps = []
    loop = EngineLoop(engine, on_step=lambda stats: steps.append(time.monotonic()))
    loop.start()
    try:
        warm_workers(engine)
        _free_latency(loop, "warmup")
        alone = [_free_latency(loop, f"alone-{i}") for i in range(3)]
        schemas = [costly_schema() for _ in range(3)]
        started = time.perf_counter()
        costly = [
            loop.submit(EngineRequest(f"costly-{i}", PROMPT, constrained(s)))
            for i, s in enumerate(schemas)
        ]
        submit_seconds = time.perf_counter() - started
        # Several samples: a neighbour's load (another test worker) only ever adds time, so the
        # quickest batch beside the compiles is the fair one to compare.
        during = [_free_latency(loop, f"during-{i}") for i in range(3)]
        still_compiling = engine.grammar_compiler.workers.num_busy
        finals = [collect(stream)[-1] for stream in costly]
    finally:
        loop.stop(timeout=60)
    # The submits did not wait for the compiles, the free requests ran while all of them
    # compiled, and their latency stayed well under twice what it is alone.
    assert submit_seconds < 3 * engine_loop_module.SUBMIT_GRAMMAR_WAIT_S + 0.5
    assert still_compiling >= 1
    assert min(during) < 2 * statistics.median(alone), (during, alone)
    for final, schema in zip(finals, schemas, strict=True):
        assert final.error is None, final.error
        if final.outputs[0].finish_reason == "stop":
            check_pattern_output(final.outputs[0].text, schema)
    assert_pool_released(engine)


def test_a_compile_past_the_timeout_fails_alone_and_its_worker_is_killed():
    engine = shakespeare_engine(structured_outputs_compile_timeout_s=1.0)
    loop = EngineLoop(engine)
    loop.start()
    try:
        warm_workers(engine)
        workers = engine.grammar_compiler.workers
        stuck_schema = costly_schema(STUCK_N)
        stuck = loop.submit(EngineRequest("stuck", PROMPT, constrained(stuck_schema)))
        good = loop.submit(
            EngineRequest(
                "good",
                "KING:",
                SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": REGEX}),
            )
        )
        plain = loop.submit(EngineRequest("plain", PROMPT, free()))
        time.sleep(0.3)
        pids_while_stuck = workers.worker_pids
        started_before = workers.num_started
        outputs = {s.request_id: collect(s)[-1] for s in (stuck, good, plain)}
        after = loop.submit(EngineRequest("after", PROMPT, constrained({"type": "boolean"})))
        outputs["after"] = collect(after)[-1]
    finally:
        loop.stop(timeout=60)
    failed = outputs["stuck"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error_code is ErrorCode.INVALID_INPUT
    assert failed.error.startswith("structured_outputs.json was not compiled within ")
    assert "structured_outputs_compile_timeout_s (1 s)" in failed.error
    assert stuck_schema["pattern"][:20] in failed.error  # names the constraint
    assert outputs["good"].error is None and re.fullmatch(REGEX, outputs["good"].outputs[0].text)
    assert outputs["plain"].error is None
    assert len(outputs["plain"].outputs[0].token_ids) == FREE_TOKENS
    # The worker that ran the stuck compile was killed and reaped; the next constraint got a
    # worker again (a replacement when none was left).
    killed = [pid for pid in pids_while_stuck if pid not in workers.worker_pids]
    assert len(killed) == 1 and process_gone(killed[0])
    assert outputs["after"].error is None and outputs["after"].outputs[0].text in ("true", "false")
    assert workers.num_started >= started_before
    assert_pool_released(engine)


def test_identical_constraints_arriving_together_compile_once():
    engine = shakespeare_engine()
    warm_workers(engine)
    compiled: list[float] = []
    loop = EngineLoop(engine, on_step=lambda stats: compiled.extend(stats.grammar_compile_seconds))
    engine.stats()  # drain the warm-up's compile
    loop.start()
    try:
        schema = costly_schema(1500)
        streams = [
            loop.submit(EngineRequest(f"same-{i}", PROMPT, constrained(schema))) for i in range(3)
        ]
        finals = [collect(stream)[-1] for stream in streams]
    finally:
        loop.stop(timeout=60)
    assert all(final.error is None for final in finals)
    assert len({final.outputs[0].text for final in finals}) == 1  # greedy, same grammar
    compiled += engine.stats().grammar_compile_seconds
    assert len(compiled) == 1
    assert engine.prepare_request(
        EngineRequest("again", PROMPT, constrained(schema)), grammar_wait=0
    ).grammar
    assert_pool_released(engine)


def test_held_requests_count_toward_the_queue_and_abort_cleanly():
    engine = shakespeare_engine(max_queue_size=2)
    warm_workers(engine)
    held_request(engine, "held-0", costly_schema())
    held_request(engine, "held-1", costly_schema())
    with pytest.raises(QueueFullError, match=r"queue full: 2 requests waiting"):
        engine.add_request("free", PROMPT, free())
    with pytest.raises(InputError, match="already running"):
        engine.add_request("held-0", PROMPT, free())
    aborted = engine.abort_request("held-0")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    failed = engine.fail_request("held-1", "engine failure: test")
    assert failed.outputs[0].finish_reason == "error" and failed.error == "engine failure: test"
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert_pool_released(engine)


def test_a_compile_error_found_after_submission_is_an_input_error():
    engine = shakespeare_engine()
    warm_workers(engine)
    # Every worker busy with a costly compile: the bad regex queues behind them, so its error
    # is found after submission (a free worker can find it before `grammar_wait=0` looks).
    costly = [f"costly-{i}" for i in range(engine.grammar_compiler.max_workers)]
    for request_id in costly:
        held_request(engine, request_id, costly_schema())
    prepared = engine.prepare_request(
        EngineRequest("bad", PROMPT, SamplingParams(structured_outputs={"regex": "a(b"})),
        grammar_wait=0,
    )
    assert prepared.grammar_job is not None and not prepared.grammar_job.done()
    engine.add_prepared(prepared)
    engine.add_request("free", PROMPT, free(4))
    finals = {}
    while "bad" not in finals or "free" not in finals:
        if not engine.needs_step():
            prepared.grammar_job.wait(60)
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    for request_id in costly:
        engine.abort_request(request_id)
    bad = finals["bad"]
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error_code is ErrorCode.INVALID_INPUT
    assert re.match(r"structured_outputs\.regex cannot be compiled: .*parenthesis", bad.error)
    assert finals["free"].error is None
    assert_pool_released(engine)


def test_a_quick_compile_error_is_refused_at_submission_through_the_loop():
    engine = shakespeare_engine()
    warm_workers(engine)
    loop = EngineLoop(engine)
    loop.start()
    try:
        try:
            stream = loop.submit(
                EngineRequest(
                    "bad", PROMPT, SamplingParams(structured_outputs={"grammar": 'root ::= "a" |'})
                )
            )
        except InputError as exc:  # the usual case: the worker answered within the wait
            message = str(exc)
        else:  # a loaded machine: the same error, as the request's own
            final = collect(stream)[-1]
            assert final.error_code is ErrorCode.INVALID_INPUT
            message = final.error
    finally:
        loop.stop(timeout=60)
    assert message.startswith("structured_outputs.grammar cannot be compiled")


def test_closing_the_engine_kills_its_workers():
    engine = shakespeare_engine()
    engine.grammar_compiler.max_workers = 3  # a pool of its own (pools are shared per count)
    warm_workers(engine)
    held_request(engine, "held", costly_schema(STUCK_N))
    workers = engine.grammar_compiler.workers
    pids = workers.worker_pids
    assert pids
    engine.abort_request("held")
    engine.close()
    assert all(process_gone(pid) for pid in pids)
    assert workers.worker_pids == []
    with pytest.raises(InputError, match="shut down"):
        engine.prepare_request(EngineRequest("late", PROMPT, constrained({"type": "null"})))


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from transformers import AutoTokenizer
    import xgrammar as xgr
    from backend_lib.llm.structured.compile_worker import CompileError, CompileWorkers
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[2])
    pool = CompileWorkers(info, max_workers=1)
    schema = {"type": "string", "pattern": "^(x|y|xy|yx){1,20000}$"}  # minutes of compile
    pool.submit(("json", json.dumps(schema), None), timeout_s=600)
    while not pool.worker_pids:
        time.sleep(0.05)
    print(pool.worker_pids[0], flush=True)
    time.sleep(2)  # the worker is compiling now
    os.kill(os.getpid(), 9)
    """
)


def test_workers_die_with_their_process():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    process = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == -9, process.stderr
    worker = int(process.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not process_gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(worker)


def test_a_pool_closed_while_compiling_fails_what_waits():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[2])
    pool = CompileWorkers(info, max_workers=1)
    running = pool.submit(("json", json.dumps(costly_schema(STUCK_N)), None), timeout_s=600)
    queued = pool.submit(("regex", "[ab]", None), timeout_s=600)
    deadline = time.monotonic() + 60
    while not pool.num_compiling:  # the worker started and took the costly one
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = pool.worker_pids
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(30)
    for future in (running, queued):
        with pytest.raises(Exception, match="shut down"):
            future.result(timeout=5)
    assert all(process_gone(pid) for pid in pids)


def test_a_worker_that_dies_fails_its_constraint_alone_and_is_replaced():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[2])
    pool = CompileWorkers(info, max_workers=1)
    try:
        doomed = pool.submit(("json", json.dumps(costly_schema(STUCK_N)), None), timeout_s=600)
        deadline = time.monotonic() + 60
        while not pool.num_compiling:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        with pytest.raises(CompileError, match=r"worker exited \(exit code -9\)"):
            doomed.result(timeout=30)
        grammar, _ = pool.submit(("regex", "[ab]{2}", None), timeout_s=60).result(timeout=60)
        assert xgr.GrammarMatcher(grammar).accept_string("ab")
        assert pool.num_started == 2 and pid not in pool.worker_pids
    finally:
        pool.close()


def test_the_timeout_counts_compile_cpu_time_not_time_spent_waiting_for_the_cpu():
    """A worker kept off the CPU (here: stopped) for twice the timeout still compiles a cheap
    constraint: only the CPU it spends counts, so a busy machine cannot fail a constraint."""
    model_dir, _ = byte_level_checkpoint("shakespeare")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[2])
    pool = CompileWorkers(info, max_workers=1)
    try:
        pool.submit(("regex", "[ab]", None), timeout_s=60).result(timeout=120)  # worker ready
        (pid,) = pool.worker_pids
        pattern = costly_pattern(800)  # a fraction of a CPU second
        os.kill(pid, signal.SIGSTOP)
        try:
            job = pool.submit(
                ("json", json.dumps({"type": "string", "pattern": pattern}), None), 1.5
            )
            time.sleep(3.0)
            assert not job.done()
        finally:
            os.kill(pid, signal.SIGCONT)
        grammar, seconds = job.result(timeout=60)
        assert seconds < 1.5
        a, b = pattern[2], pattern[4]  # ^(a|b|ab|ba){1,n}$
        assert xgr.GrammarMatcher(grammar).accept_string(json.dumps(a + b + b + a))
        assert pool.worker_pids == [pid] and pool.num_started == 1
    finally:
        pool.close()
