"""A background thread driving an LLMEngine, for callers on other threads (Triton's model.py).

The engine is not thread-safe, so only the loop thread touches it: callers hand requests and
aborts over under a lock, and read each request's outputs from its own queue. The loop sleeps on
a condition variable while there is nothing to do (no polling): no request in the engine's
scheduler, or only requests waiting for their grammar, whose compile (in a worker process) wakes
it when done; a request's deadline bounds the sleep, so it ends when due. `submit` waits at most SUBMIT_GRAMMAR_WAIT_S for a constraint's grammar.

    loop = EngineLoop(engine, on_step=update_metrics)
    loop.start()
    stream = loop.submit(EngineRequest("r1", "Hello", SamplingParams(max_tokens=32)))  # InputError now
    for output in stream:      # RequestOutputs until one has finished=True
        send(output.outputs[0].delta_text)
    loop.stop()                # aborts whatever still runs, joins the thread
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

from backend_lib.contract import ErrorCode
from backend_lib.errors import InputError, QueueFullError, TenantLimitError
from backend_lib.llm.core.outputs import CompletionOutput, RequestOutput
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.stats import EngineStats
from backend_lib.llm.core.tenants import queue_full_reason
from backend_lib.llm.engine.input_processor import PreparedRequest
from backend_lib.llm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

SUBMIT_GRAMMAR_WAIT_S = 0.05
"""Longest `submit` waits for a constraint's grammar: a cache hit, a quick compile or a quick
failure (then an InputError at once); past it the request is accepted and the engine holds it
until its grammar is ready (a constraint that then fails to compile fails the request)."""


class OutputStream:
    """The outputs of one request, in order; the last one has `finished=True`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestOutput] = queue.Queue()
        self.on_output: Callable[[], None] | None = None
        """Called (on the loop thread) after each output is queued, e.g. to wake a responder."""

    def put(self, output: RequestOutput) -> None:
        """Called by the loop thread."""
        self._queue.put(output)
        if self.on_output is not None:
            self.on_output()

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises queue.Empty after `timeout` seconds without one."""
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return


class EngineLoop:
    """Runs `engine.step()` on a background thread while requests are unfinished."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[EngineStats], None] | None = None,
        on_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        """`on_step` is called on the loop thread with `engine.stats()` after every step (and
        after aborts), e.g. to update Prometheus metrics; its exceptions are logged only.
        `on_failure` is called on the loop thread with the error of an iteration that failed,
        after the requests it ran were failed."""
        self.engine = engine
        self.on_step = on_step
        self.on_failure = on_failure
        self._cond = threading.Condition()
        self._new: list[PreparedRequest] = []
        self._aborts: list[str] = []
        self._deferred: set[str] = set()
        """Ids of the requests in `_new` that the engine refused at the last iteration (its queue
        was full); they are added again at the next."""
        self._streams: dict[str, OutputStream] = {}
        """Requests submitted and not finished yet."""
        self._num_waiting = 0
        self._waiting_by_tenant: dict[str, int] = {}
        """Engine's waiting sequences after the last step (for the queue-full check)."""
        self._stopping = False
        self._thread: threading.Thread | None = None
        engine.on_grammar_ready = self._wake
        engine.interrupts.arrivals = self._arrivals

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="llm-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest) -> OutputStream:
        """Queue a request; its outputs arrive on the returned stream.

        Raises InputError (bad input, duplicate id, an adapter that cannot be served, a
        constraint that failed to compile within SUBMIT_GRAMMAR_WAIT_S) or QueueFullError in the
        caller's thread, before anything is queued.
        """
        prepared = self.engine.prepare_request(request, grammar_wait=SUBMIT_GRAMMAR_WAIT_S)
        request_id = prepared.request_id
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine loop is stopped")
            if request_id in self._streams:
                raise InputError(f"request id {request_id!r} is already running")
            max_queue = self.engine.config.max_queue_size
            if self._num_waiting + len(self._new) >= max_queue:
                raise QueueFullError(
                    f"queue full: {self._num_waiting + len(self._new)} requests "
                    f"waiting (max_queue_size={max_queue})"
                )
            self._check_tenant_queue(request)
            stream = OutputStream(request_id)
            self._streams[request_id] = stream
            self._new.append(prepared)
            self._cond.notify()
        return stream

    def _check_tenant_queue(self, request: EngineRequest) -> None:
        """TenantLimitError when the request's tenant has max_queued_per_tenant waiting (as the
        last step counted them, plus those submitted since)."""
        limit = self.engine.config.max_queued_per_tenant
        if not limit:
            return
        tenant = request.tenant_key
        waiting = self._waiting_by_tenant.get(tenant, 0)
        waiting += sum(p.request.tenant_key == tenant for p in self._new)
        reason = queue_full_reason(tenant, waiting, limit)
        if reason is not None:
            raise TenantLimitError(reason)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (its stream then gets a final "abort" output).
        A no-op for unknown or finished requests."""
        with self._cond:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request (each stream gets its final output) and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None:
            self._shutdown()  # never started: no other thread touches the engine
        else:
            self._thread.join(timeout)

    def _arrivals(self) -> list[EngineRequest]:
        """The requests submitted since the iteration began whose grammar (if any) is ready, in
        submission order: a step in flight may yield to them (engine/step_interrupts.py). Not
        those the engine refused for now (deferred): the next step could not take them either.
        Called before each layer of such a step, so the common case, none, takes no lock."""
        if not self._new:
            return []
        with self._cond:
            return [
                p.request
                for p in self._new
                if p.grammar_job is None and p.request_id not in self._deferred
            ]

    def _wake(self) -> None:
        """A held request's grammar is done (called on a compile thread)."""
        with self._cond:
            self._cond.notify()

    # --- loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._new or self._aborts or self._stopping or self.engine.needs_step()):
                    # Asleep only until the next deadline is due (None: until woken).
                    self._cond.wait(self.engine.seconds_to_next_due())
                if self._stopping:
                    break
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
            try:
                self._iteration(new, aborts)
            except Exception as exc:  # an engine bug: fail what runs, keep the loop alive
                logger.exception("engine loop iteration failed")
                self._abort_all(error=f"engine failure: {type(exc).__name__}: {exc}")
                if self.on_failure is not None:
                    self.on_failure(exc)
        self._shutdown()

    def _iteration(self, new: list[PreparedRequest], aborts: list[str]) -> None:
        engine = self.engine
        deferred: dict[str, PreparedRequest] = {}
        for prepared in new:
            try:
                engine.add_prepared(prepared)
            except QueueFullError:
                # `submit` admitted it on the previous step's count, but sequences preempted
                # since then refilled the engine's queue: an admitted request is never refused
                # late, it enters after a later step.
                deferred[prepared.request_id] = prepared
            except InputError as exc:
                self._deliver(_unserved(prepared.request_id, "error", str(exc), prepared))
        for request_id in aborts:
            if request_id in deferred:
                self._deliver(_unserved(request_id, "abort", None, deferred.pop(request_id)))
                continue
            output = engine.abort_request(request_id)
            if output is not None:
                self._deliver(output)
        with self._cond:
            self._new[:0] = deferred.values()
            self._deferred = set(deferred)
        for output in engine.expire():  # answered now, not after the step
            self._deliver(output)
        if engine.needs_step():
            for output in engine.step():
                self._deliver(output)
        if engine.fatal_error is not None:  # the engine cannot serve anything any more
            raise engine.fatal_error
        stats = engine.stats()
        with self._cond:
            self._num_waiting = stats.num_waiting
            self._waiting_by_tenant = stats.waiting_by_tenant
        if self.on_step is not None:
            try:
                self.on_step(stats)
            except Exception:
                logger.exception("on_step callback failed")

    def _shutdown(self) -> None:
        with self._cond:
            new, self._new = self._new, []
        for prepared in new:
            self._deliver(_unserved(prepared.request_id, "abort", None, prepared))
        self._abort_all(error=None)

    def _abort_all(self, error: str | None) -> None:
        """Finish every open stream: abort (or, with an error, fail) what the engine runs and
        close the rest."""
        with self._cond:
            request_ids = list(self._streams)
            self._new = []  # their streams close below; none may reach the engine afterwards
        for request_id in request_ids:
            if error is None:
                output = self.engine.abort_request(request_id)
            else:
                output = self.engine.fail_request(request_id, error)
            if output is None:  # lost between submit and the engine (after a failed iteration)
                output = _unserved(request_id, "abort" if error is None else "error", error)
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        with self._cond:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
        if stream is not None:
            stream.put(output)


def _unserved(
    request_id: str, finish_reason: str, error: str | None, prepared: PreparedRequest | None = None
) -> RequestOutput:
    """Final output of a request that never ran in the engine."""
    completion = CompletionOutput(0, "", [], "", [], None, None, finish_reason=finish_reason)
    return RequestOutput(
        request_id,
        prepared.prompt if prepared else None,
        list(prepared.prompt_token_ids) if prepared else [],
        outputs=[completion],
        finished=True,
        error=error,
        error_code=None if error is None else ErrorCode.INTERNAL,
    )
