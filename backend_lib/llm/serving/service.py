"""The llm model's request handling: Triton request tensors in, engine loop, response tensors out.

Semantics follow Triton's vLLM backend: a streaming request gets one response per engine step with only
the new text (outputs queued while the responder was busy merge into one response), the last one
final; a non-streaming request gets exactly one (final) response, with the
prompt prepended unless `exclude_input_in_output` is true. The extra outputs appear only when their
`return_*` flag is set. model.py only moves these tensors in and out of `pb_utils`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from backend_lib.config import from_parameters
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.engine import LLMEngine
from backend_lib.llm.core.outputs import CompletionOutput, RequestOutput
from backend_lib.llm.lora.registry import read_multi_lora
from backend_lib.llm.serving.engine_loop import EngineLoop, OutputStream
from backend_lib.llm.serving.metrics import LLMMetrics
from backend_lib.llm.serving.triton_request import GenerateRequest, parse_generate_request
from backend_lib.metrics import MetricsSink
from backend_lib.model_context import ModelContext

logger = logging.getLogger(__name__)

# How often a request waiting for output checks whether its client went away.
CANCEL_POLL_SECONDS = 0.1

FAULT_INJECTION_ENV = "BACKEND_LIB_FAULT_INJECTION"
"""TEST-ONLY: when set, prompts containing its value fail inside the engine step (see
`LLMService.fault_marker`). Never set it in production."""
_FAULT_ID_PREFIX = "fault-"

Tensors = dict[str, np.ndarray]
SendFn = Callable[["Tensors | Exception", bool], None]
"""Sends one response (tensors or an error) to the client; the bool says it is the final one."""


class RequestCancelled(Exception):
    """The client cancelled or disconnected; the engine request was aborted and its blocks freed."""


@dataclass
class Job:
    """One submitted request and what its responses have carried so far."""

    request_id: str
    request: GenerateRequest
    stream: OutputStream
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_logprobs: dict[int, int] = field(default_factory=dict)
    responded: bool = False
    cancelled: bool = False


class LLMService:
    """Owns the engine loop of one llm model instance."""

    def __init__(
        self, engine: LLMEngine, metrics: LLMMetrics | None = None, fault_marker: str | None = None
    ):
        """`fault_marker` is a TEST-ONLY hook: a request whose prompt contains it fails with an
        "injected fault" error raised inside the engine step (through `engine.fault_injector`),
        so tests can check that one failing request leaves the others and the engine intact."""
        self.engine = engine
        self.config = engine.config
        self.fault_marker = fault_marker or None
        if self.fault_marker:
            engine.fault_injector = _inject_fault
        self.metrics = metrics
        self.loop = EngineLoop(engine, on_step=metrics.update if metrics else None)
        self.loop.start()
        self.responder = Responder(self)

    @classmethod
    def from_context(cls, context: ModelContext, sink: MetricsSink | None) -> LLMService:
        """Load from the model's config.pbtxt parameters (ConfigError names a bad key) and, with
        enable_lora, the adapters listed in `<version>/multi_lora.json` (as the vLLM backend).
        The environment variable BACKEND_LIB_FAULT_INJECTION sets the test-only `fault_marker`."""
        config = from_parameters(LLMConfig, context.parameters)
        lora_modules = (
            read_multi_lora(context.model_dir / context.version, context.model_dir)
            if config.enable_lora
            else None
        )
        engine = LLMEngine.from_config(config, context.model_dir, context.device, lora_modules)
        metrics = None
        if sink:
            # vLLM's `model_name` label beside model/version: vLLM dashboards and routers key on it.
            metrics = LLMMetrics(
                sink.with_labels(model_name=context.name),
                engine.max_model_len,
                block_size=config.block_size,
                num_blocks=engine.runner.num_blocks,
                lora_names=engine.lora_registry.names if engine.lora_registry else None,
                max_loras=config.max_loras,
            )
        return cls(engine, metrics, fault_marker=os.environ.get(FAULT_INJECTION_ENV))

    def submit(self, inputs: dict[str, np.ndarray]) -> Job:
        """Parse and queue one request; InputError / QueueFullError at once for this caller."""
        request = parse_generate_request(
            inputs,
            max_prompt_bytes=self.config.max_prompt_bytes,
            max_logprobs=self.config.max_logprobs,
            max_n=self.config.max_n,
        )
        params = request.params
        if params.max_tokens is not None and params.max_tokens > self.engine.max_model_len:
            raise InputError(
                f"max_tokens must be <= max_model_len ({self.engine.max_model_len}), "
                f"got {params.max_tokens}"
            )
        if request.return_flags["return_cumulative_logprob"] and params.logprobs is None:
            params.logprobs = 0  # the sampled token's logprob is needed for the running sum
        request_id = uuid.uuid4().hex
        if self.fault_marker and self.fault_marker in request.prompt:
            request_id = _FAULT_ID_PREFIX + request_id  # the test-only hook fails it in a step
        stream = self.loop.submit(request_id, request.prompt, params, lora_name=request.lora_name)
        return Job(request_id, request, stream)

    def start(
        self, inputs: dict[str, np.ndarray], send: SendFn, is_cancelled: Callable[[], bool]
    ) -> Job:
        """Submit one request whose responses the responder thread passes to `send(tensors or
        error, final)`; `is_cancelled` is polled. InputError / QueueFullError at once here."""
        try:
            job = self.submit(inputs)
        except Exception as exc:
            self._record_failure(exc)
            raise
        self.responder.add(job, send, is_cancelled)
        return job

    def _record_failure(self, error: Exception) -> None:
        if self.metrics is None:
            return
        if isinstance(error, InputError):
            self.metrics.record_failure("invalid_input")
        elif isinstance(error, QueueFullError):
            self.metrics.record_failure("queue_full")
        elif not isinstance(error, RequestCancelled):
            self.metrics.record_failure("internal")

    def responses(
        self, job: Job, is_cancelled: Callable[[], bool] = lambda: False
    ) -> Iterator[tuple[Tensors | Exception, bool]]:
        """(tensors or error, final) for each response to send, until the final one: the same
        responses as `start` sends, pulled by the caller's thread (for in-process use and tests).
        `is_cancelled` is asked at most every CANCEL_POLL_SECONDS."""
        next_cancel_check = 0.0
        while True:
            now = time.monotonic()
            if not job.cancelled and now >= next_cancel_check:
                next_cancel_check = now + CANCEL_POLL_SECONDS
                if is_cancelled():
                    self.cancel(job)
            try:
                output = job.stream.get(timeout=CANCEL_POLL_SECONDS)
            except queue.Empty:
                continue
            response = self.response_for(job, _newest(job.stream, output))
            if response is not None:
                yield response
                if response[1]:
                    return

    def next_response(self, job: Job) -> tuple[Tensors | Exception, bool] | None:
        """The response for everything `job` has queued now, or None when there is nothing to
        send. Outputs are cumulative, so queued ones merge into one (fewer, larger responses when
        the sender falls behind the engine)."""
        while True:
            try:
                output = job.stream.get(timeout=0)
            except queue.Empty:
                return None
            response = self.response_for(job, _newest(job.stream, output))
            if response is not None:
                return response

    def response_for(
        self, job: Job, output: RequestOutput
    ) -> tuple[Tensors | Exception, bool] | None:
        """(tensors or error, final) for `output`, or None (a non-streaming request's partial)."""
        if output.finished and job.cancelled:
            return RequestCancelled(f"request {job.request_id} was cancelled"), True
        if output.error is not None:
            error = RuntimeError(f"generation failed: {output.error}")
            self._record_failure(error)
            return error, True
        if output.finished or job.request.stream:
            return self.response_tensors(job, output), output.finished
        return None

    def cancel(self, job: Job) -> None:
        """The client went away: abort the request (its final response says so)."""
        job.cancelled = True
        self.loop.abort(job.request_id)

    def response_tensors(self, job: Job, output: RequestOutput) -> Tensors:
        """The tensors of one response (new text since the previous response of this job)."""
        request, flags = job.request, job.request.return_flags
        completions = output.outputs
        prefix = output.prompt if request.prepend_input and not job.responded else ""
        job.responded = True
        tensors: Tensors = {
            "text_output": np.array(
                [
                    (prefix + c.text[_advance(job.sent_text, c.index, len(c.text)) :]).encode(
                        "utf-8"
                    )
                    for c in completions
                ],
                dtype=object,
            )
        }
        if flags["return_finish_reason"]:
            tensors["finish_reason"] = np.array(
                [str(c.finish_reason).encode() for c in completions], dtype=object
            )
        if flags["return_cumulative_logprob"]:
            tensors["cumulative_logprob"] = np.array(
                [
                    c.cumulative_logprob if c.cumulative_logprob is not None else np.nan
                    for c in completions
                ],
                dtype=np.float32,
            )
        if flags["return_logprobs"]:
            tensors["logprobs"] = np.array(
                [self._logprobs_json(job, c).encode("utf-8") for c in completions], dtype=object
            )
        if flags["return_num_input_tokens"]:
            tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
        if flags["return_num_output_tokens"]:
            tensors["num_output_tokens"] = np.array(
                [
                    len(c.token_ids) - _advance(job.sent_tokens, c.index, len(c.token_ids))
                    for c in completions
                ],
                dtype=np.uint32,
            )
        return tensors

    def _logprobs_json(self, job: Job, completion: CompletionOutput) -> str:
        """vLLM backend's shape: per new token, {token_id: {logprob, rank, decoded_token}}."""
        if completion.logprobs is None:
            return "null"
        start = _advance(job.sent_logprobs, completion.index, len(completion.logprobs))
        entries = []
        for position in completion.logprobs[start:]:
            entries.append(
                {
                    str(token_id): {
                        "logprob": entry.logprob,
                        "rank": entry.rank,
                        "decoded_token": self.engine.tokenizer.decode([token_id]),
                    }
                    for token_id, entry in position.items()
                }
            )
        return json.dumps(entries)

    def shutdown(self) -> None:
        self.loop.stop(timeout=30)  # running requests get their final (abort) outputs first
        self.responder.stop(timeout=30)


def _newest(stream: OutputStream, output: RequestOutput) -> RequestOutput:
    """The newest output already queued after `output` (up to the final one)."""
    while not output.finished and output.error is None:
        try:
            output = stream.get(timeout=0)
        except queue.Empty:
            break
    return output


def _advance(sent: dict[int, int], index: int, new_length: int) -> int:
    """Return how much of output `index` was sent before, and record `new_length` as sent."""
    previous = sent.get(index, 0)
    sent[index] = new_length
    return previous


def _inject_fault(request_id: str) -> None:
    """TEST-ONLY engine.fault_injector: fail the requests `submit` marked (see fault_marker)."""
    if request_id.startswith(_FAULT_ID_PREFIX):
        raise RuntimeError(f"injected fault (test hook {FAULT_INJECTION_ENV})")


def error_message(exc: Exception) -> str:
    """Message for the client: input errors as they are, others with their type."""
    if isinstance(exc, (InputError, RequestCancelled)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _Pending:
    job: Job
    send: SendFn
    is_cancelled: Callable[[], bool]


class Responder:
    """One thread that sends the responses of every running request of a model instance.

    A thread per request would wake once per token and request; at 16 streams those wake-ups
    contended for the GIL with the engine thread and slowed its steps. The responder wakes when any
    request has new output, sends one merged response per request, and polls client cancellation
    for all of them at most every CANCEL_POLL_SECONDS (each poll is a round trip to the server)."""

    def __init__(self, service: LLMService, poll_seconds: float = CANCEL_POLL_SECONDS):
        self._service, self._poll_seconds = service, poll_seconds
        self._ready: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llm-responder", daemon=True)
        self._thread.start()

    def add(self, job: Job, send: SendFn, is_cancelled: Callable[[], bool]) -> None:
        with self._lock:
            self._pending[job.request_id] = _Pending(job, send, is_cancelled)
        job.stream.on_output = lambda: self._ready.put(job.request_id)
        self._ready.put(job.request_id)  # outputs queued before on_output was set

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def stop(self, timeout: float | None = None) -> None:
        """Send what is queued, then end the thread."""
        self._stopping = True
        self._ready.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        next_poll = 0.0
        while True:
            try:
                ready = {self._ready.get(timeout=self._poll_seconds)}
            except queue.Empty:
                ready = set()
            with contextlib.suppress(queue.Empty):
                while True:
                    ready.add(self._ready.get_nowait())
            for request_id in ready - {None}:
                self._send_ready(request_id)
            if self._stopping:
                return
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self._poll_seconds
                self._poll_cancellations()

    def _send_ready(self, request_id: str) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:
            return
        try:
            response = self._service.next_response(pending.job)
        except Exception as exc:  # a bug building this response: fail this request alone
            logger.exception("building a response of request %s failed", request_id)
            self._service.cancel(pending.job)
            response = (RuntimeError(f"building the response failed: {exc}"), True)
        if response is None:
            return
        try:
            pending.send(*response)
        except Exception:  # the client's connection is gone: nothing more can reach it
            logger.exception("sending a response of request %s failed", request_id)
            self._service.cancel(pending.job)
            response = (None, True)
        if response[1]:
            with self._lock:
                del self._pending[request_id]

    def _poll_cancellations(self) -> None:
        with self._lock:
            pending = [p for p in self._pending.values() if not p.job.cancelled]
        for item in pending:
            try:
                cancelled = item.is_cancelled()
            except Exception:  # the request object is unusable: treat the client as gone
                logger.exception("is_cancelled of request %s failed", item.job.request_id)
                cancelled = True
            if cancelled:
                self._service.cancel(item.job)
