"""The llm model's request handling: Triton request tensors in, engine loop, response tensors out.

Semantics follow Triton's vLLM backend: a streaming request gets one response per engine step with only
the new text (outputs queued while the responder was busy merge into one response), the last one
final; a non-streaming request gets exactly one (final) response, with the
prompt prepended unless `exclude_input_in_output` is true. The extra outputs appear only when their
`return_*` flag is set. A request with `describe` set is answered at once with the model's
published facts (`LLMService.facts`, backend_lib/contract.py). model.py only moves these tensors in
and out of `pb_utils`, and sends an error with `backend_lib.errors.response_error`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from backend_lib import contract
from backend_lib.config import ConfigError, from_parameters
from backend_lib.errors import (
    InputError,
    ModelUnavailable,
    RequestCancelled,
    error_code,
    request_error,
)
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.outputs import CompletionOutput, Logprob, RequestOutput
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.engine.fault_injection import PromptMarkerFaults
from backend_lib.llm.engine.llm_engine import LLMEngine
from backend_lib.llm.execution.workers import WorkerDied
from backend_lib.llm.lora.registry import read_multi_lora
from backend_lib.llm.serving.engine_loop import EngineLoop, OutputStream
from backend_lib.llm.serving.kv_event_publisher import KVEventStream
from backend_lib.llm.serving.metrics import LLMMetrics
from backend_lib.llm.serving.triton_request import GenerateRequest, parse_generate_request
from backend_lib.metrics import MetricsSink
from backend_lib.model_context import ModelContext
from backend_lib.triton_io import read_scalar

logger = logging.getLogger(__name__)

# How often a request waiting for output checks whether its client went away.
CANCEL_POLL_SECONDS = 0.1


Tensors = dict[str, np.ndarray]
SendFn = Callable[["Tensors | Exception", bool], None]
"""Sends one response (tensors or an error) to the client; the bool says it is the final one."""


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
    sent_prompt_logprobs: bool = False
    cancelled: bool = False


class LLMService:
    """Owns the engine loop of one llm model instance."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: LLMMetrics | None = None,
        faults: PromptMarkerFaults | None = None,
        unload: Callable[[], None] | None = None,
        kv_events: KVEventStream | None = None,
    ):
        """`faults` (TEST-ONLY, engine/fault_injection.py): requests whose prompt holds its marker
        fail inside the engine step, so tests can check that one failing request leaves the
        others and the engine intact. `unload`: asks the server to unload this model (Triton's
        `pb_utils.unload_model`, as the vLLM backend does), called once when a worker process
        dies; from then on every request fails at once with `ModelUnavailable`. `kv_events`: where
        the prefix cache's changes go after each step (`kv_events_config`)."""
        self.engine = engine
        self.config = engine.config
        self.faults = faults
        if faults is not None:
            engine.fault_injector = faults
        self.metrics = metrics
        self.unload = unload
        self.unavailable: ModelUnavailable | None = None
        """Set when a worker process died: the model cannot serve until it is loaded again."""
        self._unload_due = False
        """Set with `unavailable`: the next execute asks the server to unload the model."""
        self.kv_events = kv_events
        self.loop = EngineLoop(engine, on_step=self._on_step, on_failure=self._engine_failed)
        self.loop.start()
        self.responder = Responder(self)

    def _on_step(self, stats) -> None:
        """After each engine step (on the loop thread): metrics, then the step's KV events."""
        if self.metrics is not None:
            self.metrics.update(stats)
        if self.kv_events is not None:
            self.kv_events.flush()

    def _engine_failed(self, error: Exception) -> None:
        """A worker process that died leaves the model unable to serve (its shard is gone): mark
        it unavailable and ask to be unloaded, so that it can be loaded anew. Any other engine
        failure failed only the requests of that step."""
        if not isinstance(error, WorkerDied) or self.unavailable is not None:
            return
        remedy = (
            "it asks to be unloaded: load it again"
            if self.unload is not None
            else "restart the server, or serve it under explicit model control to reload it"
        )
        self.unavailable = ModelUnavailable(f"the model is unavailable: {error} ({remedy})")
        logger.error("%s", self.unavailable)
        self._unload_due = self.unload is not None

    def unload_if_unavailable(self) -> None:
        """Ask the server, once, to unload a model whose engine can no longer serve. Called on
        the model's execute thread, at its next requests (as the vLLM backend does): the Python
        backend's model-loader call is not safe from another thread (it raced the stub's shared
        memory, and the stub crashed), and on the loop thread the unload would join itself."""
        if not self._unload_due:
            return
        self._unload_due = False
        try:
            self.unload()
        except Exception:  # e.g. the server does not allow explicit model control
            logger.exception("could not ask the server to unload the model")

    @classmethod
    def from_context(
        cls,
        context: ModelContext,
        sink: MetricsSink | None,
        unload: Callable[[], None] | None = None,
    ) -> LLMService:
        """Load from the model's config.pbtxt parameters (ConfigError names a bad key) and, with
        enable_lora, the adapters listed in `<version>/multi_lora.json` (as the vLLM backend).
        The environment variable BACKEND_LIB_FAULT_INJECTION sets the test-only `faults`."""
        config = from_parameters(LLMConfig, context.parameters)
        if config.world_size > 1 and context.instance_kind == "GPU":
            field = (
                "tensor_parallel_size"
                if config.tensor_parallel_size > 1
                else "pipeline_parallel_size"
            )
            raise ConfigError(
                field,
                getattr(config, field),
                "a sharded model places its own ranks (rank r on GPU r): serve it as "
                "instance_group [{kind: KIND_MODEL}], not KIND_GPU",
            )
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
                num_speculative_tokens=(
                    0 if engine.drafter is None else engine.drafter.config.num_speculative_tokens
                ),
                max_tenant_labels=config.max_tenant_labels,
                kv_offload=engine.runner.offload is not None,
            )
        faults = PromptMarkerFaults.from_environment()
        kv_events = _kv_event_stream(engine, context.device)
        return cls(engine, metrics, faults=faults, unload=unload, kv_events=kv_events)

    def submit(self, inputs: dict[str, np.ndarray], timeout_us: int = 0) -> Job:
        """Parse and queue one request; InputError / QueueFullError at once for this caller
        (ModelUnavailable once a worker process died). `timeout_us`: Triton's request timeout in
        microseconds (`request.timeout()`, 0: none), a deadline as `deadline_ms` is."""
        arrival = time.monotonic()
        if self.unavailable is not None:
            raise self.unavailable
        request = parse_generate_request(
            inputs,
            max_prompt_bytes=self.config.max_prompt_bytes,
            max_logprobs=self.config.max_logprobs,
            max_n=self.config.max_n,
            multimodal=None
            if self.engine.inputs.images is None
            else self.engine.inputs.images.config,
        )
        params = request.params
        _check_max_tokens(params.max_tokens, self.engine.max_model_len)
        if request.return_flags["return_cumulative_logprob"] and params.logprobs is None:
            params.logprobs = 0  # the sampled token's logprob is needed for the running sum
        request_id = uuid.uuid4().hex
        if self.faults is not None:  # TEST-ONLY: marked prompts fail inside a step
            request_id = self.faults.request_id(request.prompt, request_id)
        prompt = None if request.prompt_token_ids is not None else request.prompt
        images, request.images = request.images, ()  # the job keeps no decoded picture
        stream = self.loop.submit(
            EngineRequest(
                request_id,
                prompt,
                params,
                request.prompt_token_ids,
                arrival_time=arrival,
                lora_name=request.lora_name,
                deadline=_deadline(arrival, timeout_us, request.deadline_ms),
                priority=request.priority,
                tenant=request.tenant,
                images=images,
            )
        )
        return Job(request_id, request, stream)

    def facts(self) -> contract.ModelFacts:
        return published_facts(self.engine)

    def facts_tensors(self) -> Tensors:
        return {contract.MODEL_FACTS: np.array([self.facts().to_json().encode()], dtype=object)}

    def start(
        self,
        inputs: dict[str, np.ndarray],
        send: SendFn,
        is_cancelled: Callable[[], bool],
        timeout_us: int = 0,
    ) -> Job | None:
        """Submit one request whose responses the responder thread passes to `send(tensors or
        error, final)`; `is_cancelled` is polled; `timeout_us` is Triton's request timeout (see
        `submit`). InputError / QueueFullError at once here. A `describe` request gets its one
        (final) response, the facts, before this returns None."""
        try:
            describe = read_scalar(inputs, contract.DESCRIBE, bool)
            job = None if describe else self.submit(inputs, timeout_us)
        except Exception as exc:
            self._record_failure(exc)
            raise
        if job is None:
            send(self.facts_tensors(), True)
            return None
        self.responder.add(job, send, is_cancelled)
        return job

    def _record_failure(self, error: Exception) -> None:
        code = error_code(error)
        if self.metrics is not None and code is not contract.ErrorCode.CANCELLED:
            self.metrics.record_failure(code.value)  # the failure reasons are the codes' values

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
        if output.error is not None:  # e.g. a constraint that did not compile, a deadline passed
            error = request_error(output.error_code, output.error)
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
        prefix = self._prompt_text(output) if request.prepend_input and not job.responded else ""
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
            if any(c.finished for c in completions):
                tensors[contract.STOP_REASON] = np.array(
                    [json.dumps(c.stop_reason).encode() for c in completions], dtype=object
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
        if output.prompt_logprobs is not None and not job.sent_prompt_logprobs:
            job.sent_prompt_logprobs = True  # once, in the first response after the prefill
            first = output.prompt_token_ids[0]  # nothing precedes it: no logprob, no rank
            scored = [
                {str(first): {"logprob": None, "rank": None, "decoded_token": self._text(first)}},
                *(self._position_json(p) for p in output.prompt_logprobs[1:]),
            ]
            tensors[contract.PROMPT_LOGPROBS] = np.array(
                [json.dumps(scored).encode("utf-8")], dtype=object
            )
        if flags["return_num_input_tokens"]:
            tensors["num_input_tokens"] = np.array([len(output.prompt_token_ids)], dtype=np.uint32)
        if flags["return_num_cached_tokens"]:
            tensors[contract.NUM_CACHED_TOKENS] = np.array(
                [output.num_cached_tokens], dtype=np.uint32
            )
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
        return json.dumps([self._position_json(p) for p in completion.logprobs[start:]])

    def _position_json(self, position: dict[int, Logprob]) -> dict[str, dict]:
        """One position's logprobs: {token_id: {logprob, rank, decoded_token}}."""
        return {
            str(token_id): {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": self._text(token_id),
            }
            for token_id, entry in position.items()
        }

    def _prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text (a token-id prompt decoded, special tokens included)."""
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids)

    def _text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def shutdown(self) -> None:
        self.loop.stop(timeout=30)  # running requests get their final (abort) outputs first
        self.responder.stop(timeout=30)
        self.engine.close()  # the grammar compile workers end with the model
        if self.kv_events is not None:
            self.kv_events.close()


def _kv_event_stream(engine: LLMEngine, device: torch.device) -> KVEventStream | None:
    """The engine's KV event stream when `kv_events_config` enables one."""
    config = engine.config.kv_events
    if not config.enabled:
        return None
    medium = "GPU" if device.type == "cuda" else "CPU"
    return KVEventStream(config, engine.scheduler.kv_cache_manager, medium)


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


def published_facts(engine: LLMEngine) -> contract.ModelFacts:
    """What a model publishes about itself: the engine's max_model_len, the adapters its LoRA
    registry serves (none when LoRA is off), its config's output parsers, and the images a prompt
    may hold (none for a text model) and their size limit."""
    registry, images = engine.lora_registry, engine.inputs.images
    return contract.ModelFacts(
        max_model_len=engine.max_model_len,
        lora_adapters=tuple(registry.names) if registry is not None else (),
        tool_call_parser=engine.config.tool_call_parser,
        reasoning_parser=engine.config.reasoning_parser,
        max_images=0 if images is None else images.config.max_images,
        max_image_bytes=0 if images is None else images.config.limits.max_image_bytes,
    )


def _check_max_tokens(max_tokens: int | None, max_model_len: int) -> None:
    if max_tokens is not None and max_tokens > max_model_len:
        raise InputError(f"max_tokens must be <= max_model_len ({max_model_len}), got {max_tokens}")


def _deadline(arrival: float, timeout_us: int, deadline_ms: float | None) -> float | None:
    """The earlier of Triton's request timeout and `deadline_ms`, as a time.monotonic() time."""
    limits = [timeout_us / 1e6] if timeout_us > 0 else []
    limits += [deadline_ms / 1e3] if deadline_ms is not None else []
    return arrival + min(limits) if limits else None
