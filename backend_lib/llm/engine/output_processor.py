"""Output processing: each step's new tokens -> text, stop strings, logprobs, `RequestOutput`s.

Holds the engine-side state of every running request (its sequences' detokenizers and what was
already sent), finishes and fails requests (freeing their KV blocks through the scheduler) and
records the per-request statistics. Failures are contained: an exception tied to one request
(detokenization, the fault-injection seam) fails only that request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from backend_lib.contract import ErrorCode
from backend_lib.llm.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from backend_lib.llm.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from backend_lib.llm.core.sequence import Sequence, SequenceStatus
from backend_lib.llm.core.stats import FinishedRequest, StatsCollector
from backend_lib.llm.engine.detokenizer import IncrementalDetokenizer
from backend_lib.llm.engine.fault_injection import FaultHook
from backend_lib.llm.engine.input_processor import PreparedRequest
from backend_lib.llm.execution.prompt_logprobs import PromptLogprobsChunk
from backend_lib.llm.execution.sampler import TokenLogprobs
from backend_lib.llm.execution.step_sampling import ModelOutput
from backend_lib.llm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SeqState:
    """Output-side state of one sequence: its text stream and what was already sent."""

    seq: Sequence
    index: int
    """Its position among the request's n outputs."""
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    """Per output token (None: the request asked for no logprobs)."""
    cumulative_logprob: float = 0.0
    text: str = ""
    """Text released to the client so far (never a held-back partial stop string)."""
    delta_text: str = ""
    num_sent_tokens: int = 0
    last_token_time: float | None = None
    """Seconds on `time.monotonic()`."""


@dataclass(eq=False)
class RequestState:
    """One running request: its input, timestamps and sequences (n > 1: the parent first)."""

    prepared: PreparedRequest
    metrics: RequestMetrics
    seqs: list[SeqState] = field(default_factory=list)
    forked: bool = False
    """Its n > 1 children exist."""
    error: str | None = None
    error_code: ErrorCode = ErrorCode.INTERNAL
    """With `error`: why, as the client is told."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token scored so far (None for the first); None: the request asked for none."""
    final_only: bool = False
    """Only the final output is wanted (`generate`, as vLLM's FINAL_ONLY): steps build none before."""

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.seqs)


NewTokens = list[tuple[Sequence, list[TokenLogprobs | None]]]
"""A request's sequences that got tokens this step, each with its new tokens' logprobs (one
token, or several for a sequence that verified drafts; None entries: no logprobs asked)."""


class OutputProcessor:
    """The running requests' output state; builds each step's `RequestOutput`s."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler,
        structured: StructuredOutputManager,
        stats: StatsCollector,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.structured = structured
        self._stats = stats
        self.fault_hook: FaultHook | None = None
        """The fault-injection seam (engine/fault_injection.py): called with each request id whose
        tokens a step records; raising fails that request."""
        self.requests: dict[str, RequestState] = {}
        self._seq_states: dict[int, SeqState] = {}

    def add(self, prepared: PreparedRequest, seq: Sequence) -> RequestState:
        request = RequestState(prepared, RequestMetrics(prepared.arrival_time))
        if prepared.params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self._track(request, seq)
        self.requests[prepared.request_id] = request
        return request

    def request_of(self, seq_id: int) -> RequestState:
        return self.requests[self._seq_states[seq_id].seq.request_id]

    def is_forked(self, seq: Sequence) -> bool:
        """Whether `seq`'s request has forked its parallel samples (n > 1) yet."""
        return self.requests[seq.request_id].forked

    def mark_scheduled(self, sched_out: SchedulerOutput, now: float) -> None:
        for item in sched_out.scheduled:
            metrics = self.requests[item.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def record_prompt_logprobs(self, chunks: dict[int, PromptLogprobsChunk]) -> None:
        """Append each chunk's prompt-token scores to its request; positions already recorded
        (a prompt recomputed after preemption) keep their first scores."""
        for seq_id, chunk in chunks.items():
            state = self._seq_states.get(seq_id)
            if state is None:  # failed earlier in this step
                continue
            recorded = self.requests[state.seq.request_id].prompt_logprobs
            for index, entry in enumerate(chunk.entries, start=chunk.first_token):
                if index == len(recorded):
                    recorded.append(_logprob_entry(entry))

    def process(
        self,
        sched_out: SchedulerOutput,
        model_out: ModelOutput,
        forks: dict[int, list[Sequence]],
        now: float,
    ) -> list[RequestOutput]:
        """Record each new token (logprobs, text, stop strings, latencies); build the outputs of
        every request that produced tokens or finished."""
        outputs = []
        for request_id, entries in _new_tokens(sched_out, model_out, forks).items():
            request = self.requests[request_id]
            try:
                if self.fault_hook is not None:
                    self.fault_hook(request_id)
                self._record_tokens(request, entries, now)
            except Exception as exc:
                logger.exception("request %s failed", request_id)
                outputs.append(self.fail(request, describe(exc)))
                continue
            if request.finished:
                outputs.append(self.finish(request))
            elif not request.final_only:
                outputs.append(self.output(request))
        return outputs

    def fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail the step's requests, including those swapped out by it (their host copy may be
        incomplete)."""
        seqs = [item.seq for item in sched_out.scheduled]
        seqs += [s for s in sched_out.preempted if s.status is SequenceStatus.SWAPPED]
        request_ids = dict.fromkeys(s.request_id for s in seqs)
        return [
            self.fail(self.requests[r], describe(exc)) for r in request_ids if r in self.requests
        ]

    def fail(
        self, request: RequestState, error: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> RequestOutput:
        """Finish every sequence of `request` with reason "error", `error` and its `code`."""
        request.error, request.error_code = error, code
        for state in request.seqs:
            self.scheduler.finish(state.seq, "error")  # on a finished one: only the reason changes
        # Children forked in a step that failed before they were tracked here.
        for seq in self.scheduler.abort(request.prepared.request_id):
            self.structured.remove(seq.seq_id)
        return self.finish(request)

    def finish(self, request: RequestState) -> RequestOutput:
        """Final output of a request whose sequences are all finished; forgets the request."""
        metrics = request.metrics
        metrics.finished_time = time.monotonic()
        del self.requests[request.prepared.request_id]
        for state in request.seqs:
            del self._seq_states[state.seq.seq_id]
            self.structured.remove(state.seq.seq_id)
        self._stats.finished(_finished_record(request))
        return self.output(request)

    def output(self, request: RequestState) -> RequestOutput:
        prepared = request.prepared
        return RequestOutput(
            request_id=prepared.request_id,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,  # never mutated: shared, not copied
            outputs=[_completion(s) for s in request.seqs],
            finished=request.finished,
            num_cached_tokens=request.seqs[0].seq.num_cached_prompt_tokens,
            num_offloaded_cached_tokens=request.seqs[0].seq.num_offloaded_prompt_tokens,
            metrics=dataclasses.replace(request.metrics),
            error=request.error,
            error_code=None if request.error is None else request.error_code,
            prompt_logprobs=(
                None if request.prompt_logprobs is None else list(request.prompt_logprobs)
            ),
        )

    def _track(self, request: RequestState, seq: Sequence) -> SeqState:
        params = seq.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params)
        logprobs = [] if params.logprobs is not None else None
        state = SeqState(seq, len(request.seqs), detok, logprobs)
        request.seqs.append(state)
        self._seq_states[seq.seq_id] = state
        return state

    def _record_tokens(self, request: RequestState, entries: NewTokens, now: float) -> None:
        latencies = []
        num_tokens = 0
        for seq, logprobs in entries:
            state = self._seq_states.get(seq.seq_id)
            if state is None:  # a child forked in this step
                state = self._track(request, seq)
                request.forked = True
            num_tokens += self._record_new_tokens(state, logprobs)
            if state.last_token_time is not None:
                latencies.append(now - state.last_token_time)
            state.last_token_time = now
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self._stats.first_token(
                now - metrics.arrival_time, len(request.prepared.prompt_token_ids)
            )
        metrics.last_token_time = now
        self._stats.tokens(num_tokens, latencies)

    def _record_new_tokens(self, state: SeqState, logprobs: list[TokenLogprobs | None]) -> int:
        """Record the sequence's new tokens (the last len(logprobs)) in order: logprobs, then
        text; a completed stop string finishes it there, and tokens after it (accepted drafts)
        are dropped, as plain decoding would never have made them. Returns the tokens kept."""
        seq = state.seq
        first = seq.num_tokens - len(logprobs)
        delta = ""
        kept = 0
        for index, token_logprobs in enumerate(logprobs, start=first):
            kept += 1
            if token_logprobs is not None and state.logprobs is not None:
                state.logprobs.append(_logprob_entry(token_logprobs))
                state.cumulative_logprob += token_logprobs.logprob
            if index == seq.num_tokens - 1 and not _shows_last_token(seq):
                break
            piece, stop_hit = state.detok.add(seq.token_ids[index])
            delta += piece
            if stop_hit:
                del seq.token_ids[index + 1 :]
                self.scheduler.finish(seq, "stop", stop_reason=state.detok.stop_string)
                break
        if seq.is_finished:
            delta += state.detok.flush()
        state.text += delta
        state.delta_text += delta
        return kept


def _new_tokens(
    sched_out: SchedulerOutput, model_out: ModelOutput, forks: dict[int, list[Sequence]]
) -> dict[str, NewTokens]:
    """request_id -> its sequences with a new token, in scheduling order; a parent's new children
    follow it."""
    new_tokens: dict[str, NewTokens] = {}
    for item in sched_out.scheduled:
        seq = item.seq
        if seq.seq_id not in model_out.sampled:
            continue
        entries = new_tokens.setdefault(seq.request_id, [])
        children = forks.get(seq.seq_id, ())
        if not children:  # its own tokens: one, or those of its verified drafts it kept
            count = _num_appended(item)
            if count <= 0:  # finished before the update (nothing was appended)
                continue
            logprobs = model_out.logprobs.get(seq.seq_id) or [None] * count
            entries.append((seq, logprobs[:count]))
            continue
        seqs = [seq, *children]  # one sample each
        logprobs = model_out.logprobs.get(seq.seq_id) or [None] * len(seqs)
        entries.extend((s, [lp]) for s, lp in zip(seqs, logprobs, strict=True))
    return new_tokens


def _num_appended(item: ScheduledSequence) -> int:
    """Tokens the scheduler appended to a sampling sequence this step: one, or after verified
    drafts those emitted up to the first stop among them."""
    own = item.num_new_tokens - len(item.spec_token_ids)
    return item.seq.num_tokens - item.start_position - own


def _logprob_entry(logprobs: TokenLogprobs) -> dict[int, Logprob]:
    """{token_id: Logprob}: the sampled (or scored prompt) token first, as vLLM orders it, then
    the top tokens by rank."""
    entry = {logprobs.token_id: Logprob(logprobs.logprob, logprobs.rank)}
    for rank, (token, value) in enumerate(
        zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True), start=1
    ):
        entry.setdefault(token, Logprob(value, rank))
    return entry


def _shows_last_token(seq: Sequence) -> bool:
    """vLLM hides the text of the EOS / stop token that ended a sequence, unless asked."""
    stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    return not stopped_by_token or seq.sampling_params.include_stop_str_in_output


def _completion(state: SeqState) -> CompletionOutput:
    seq = state.seq
    token_ids = seq.output_token_ids
    delta_ids = token_ids[state.num_sent_tokens :]
    state.num_sent_tokens = len(token_ids)
    delta_text, state.delta_text = state.delta_text, ""
    with_logprobs = state.logprobs is not None
    return CompletionOutput(
        index=state.index,
        text=state.text,
        token_ids=token_ids,
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        cumulative_logprob=state.cumulative_logprob if with_logprobs else None,
        logprobs=list(state.logprobs) if with_logprobs else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def _finished_record(request: RequestState) -> FinishedRequest:
    metrics, params = request.metrics, request.prepared.params
    first = metrics.first_token_time
    return FinishedRequest(
        request_id=request.prepared.request_id,
        finish_reason=request.seqs[0].seq.finish_reason or "abort",
        num_prompt_tokens=len(request.prepared.prompt_token_ids),
        num_generation_tokens=sum(s.seq.num_output_tokens for s in request.seqs),
        n=params.n,
        max_tokens=params.max_tokens,
        e2e_latency=metrics.finished_time - metrics.arrival_time,
        queue_time=_elapsed(metrics.arrival_time, metrics.first_scheduled_time),
        time_to_first_token=_elapsed(metrics.arrival_time, first),
        prefill_time=_elapsed(metrics.first_scheduled_time, first),
        decode_time=_elapsed(first, metrics.last_token_time),
        tenant=request.prepared.request.tenant_key,
        priority=request.prepared.request.priority,
    )


def describe(exc: Exception) -> str:
    """An exception as the request's error text: its type and message."""
    return f"{type(exc).__name__}: {exc}"


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
