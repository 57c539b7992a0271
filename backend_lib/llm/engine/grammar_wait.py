"""Requests waiting for their grammar: held outside the scheduler until the compile finishes.

A constrained request whose grammar is still compiling (in a worker process, see
structured/compile_worker.py) holds no batch slot and no KV block, but counts toward
max_queue_size and `num_waiting` (as vLLM's WAITING_FOR_FSM). Each engine step takes the ready
ones in arrival order (never waiting on a compile); a constraint that failed to compile ends its
request with reason "error" and the compiler's input error.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from backend_lib.contract import ErrorCode
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from backend_lib.llm.core.stats import FinishedRequest, StatsCollector
from backend_lib.llm.engine.input_processor import PreparedRequest


class GrammarWait:
    """The held requests of one engine, in arrival order."""

    def __init__(self, stats: StatsCollector) -> None:
        self._stats = stats
        self._held: dict[str, PreparedRequest] = {}
        self.on_ready: Callable[[], None] | None = None
        """Called, on a compile thread, when a held request's grammar finished compiling (or
        failed): the thread driving the engine wakes to step (serving/engine_loop.py)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def get(self, request_id: str) -> PreparedRequest | None:
        """The held request of this id (None: not held)."""
        return self._held.get(request_id)

    def hold(self, prepared: PreparedRequest) -> None:
        self._held[prepared.request_id] = prepared
        prepared.grammar_job.add_done_callback(self._done)

    def any_ready(self) -> bool:
        return any(p.grammar_job.done() for p in self._held.values())

    def wait_any(self, timeout_s: float) -> None:
        """Sleep until one held grammar is done (or `timeout_s` passes)."""
        jobs = [p.grammar_job.future for p in self._held.values()]
        wait_futures(jobs, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def release(
        self,
        request_id: str,
        reason: str,
        error: str | None,
        error_code: ErrorCode | None = None,
    ) -> RequestOutput | None:
        """End a held request now (abort, or fail with `error` and its code); None when it is not
        held."""
        prepared = self._held.pop(request_id, None)
        return None if prepared is None else self._final(prepared, reason, error, error_code)

    def admit_ready(self, queue: Callable[[PreparedRequest], None]) -> list[RequestOutput]:
        """`queue` each held request whose grammar is ready, in arrival order; the final outputs
        of those whose constraint did not compile (or that `queue` refused as input errors)."""
        failed: list[RequestOutput] = []
        for request_id, prepared in list(self._held.items()):
            job = prepared.grammar_job
            if not job.done():
                continue
            try:
                prepared.grammar = job.result()
                queue(prepared)
            except QueueFullError:  # preempted sequences refilled the queue: a later step
                prepared.grammar = None
                break
            except InputError as exc:
                del self._held[request_id]
                failed.append(self._final(prepared, "error", str(exc), ErrorCode.INVALID_INPUT))
                continue
            prepared.grammar_job = None
            del self._held[request_id]
        return failed

    def _done(self) -> None:
        callback = self.on_ready
        if callback is not None:
            callback()

    def _final(
        self,
        prepared: PreparedRequest,
        reason: str,
        error: str | None,
        error_code: ErrorCode | None = None,
    ) -> RequestOutput:
        """Final output of a held request that never reached the scheduler."""
        now = time.monotonic()
        params = prepared.params
        self._stats.finished(
            FinishedRequest(
                request_id=prepared.request_id,
                finish_reason=reason,
                num_prompt_tokens=len(prepared.prompt_token_ids),
                num_generation_tokens=0,
                n=params.n,
                max_tokens=params.max_tokens,
                e2e_latency=now - prepared.arrival_time,
                queue_time=None,
                time_to_first_token=None,
                prefill_time=None,
                decode_time=None,
                tenant=prepared.request.tenant_key,
                priority=prepared.request.priority,
            )
        )
        completion = CompletionOutput(0, "", [], "", [], None, None, finish_reason=reason)
        return RequestOutput(
            prepared.request_id,
            prepared.prompt,
            prepared.prompt_token_ids,
            outputs=[completion],
            finished=True,
            metrics=RequestMetrics(prepared.arrival_time, finished_time=now),
            error=error,
            error_code=error_code,
        )
