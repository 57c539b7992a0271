"""LLMEngine: synchronous, step-based generation joining scheduler, model runner and detokenizer.

One `step()` = schedule -> runner.execute (block moves, forward, sampling) -> scheduler.update
(token-level stops, parallel-sampling forks) -> detokenize (stop strings) -> one RequestOutput per
request that produced tokens or finished. Not thread-safe: one thread drives it (see engine_loop).

Failures are contained: an exception tied to one request (detokenization, the `fault_injector`
test hook) fails only that request; an exception in the forward (or anywhere in execute/update)
fails every request of that step. Failed requests finish with reason "error", the message in
`RequestOutput.error`, and their KV blocks freed; the engine keeps serving the others.

Structured outputs (`SamplingParams.structured_outputs`): the constraint is compiled at
`prepare_request` (bad ones are an InputError naming the field); each constrained sequence keeps an
xgrammar matcher (backend_lib/llm/structured/), whose next-token bitmask the runner fills during
the forward and applies before sampling. Every sampled token advances the matcher; a terminated
grammar finishes the sequence with "stop"; a grammar allowing no token (or refusing the sampled
one) fails that request with reason "error" while the others continue.

LoRA (`enable_lora`, adapters named in `lora_modules`): a request names its adapter with
`lora_name`; `prepare_request` resolves it through the LoRARegistry (loading it into host memory
on first use, on the caller's thread: an unknown name, LoRA disabled or a bad adapter directory is
an InputError for that request only). The sequence carries its LoRARequest through scheduling,
preemption and forks; the scheduler keeps at most max_loras adapters running; the runner maps
each row to its adapter's device slot.

Length policy: `max_tokens=None` generates up to max_model_len; a `max_tokens` beyond what fits
(max_model_len - prompt) is not an error, the output just stops at max_model_len with "length"
(vLLM's engine behaviour). Only a prompt leaving no room for one output token is refused.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from backend_lib.checkpoint import HF_OFFLINE_KWARGS, resolve_model_path
from backend_lib.config import require
from backend_lib.errors import InputError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.detokenizer import IncrementalDetokenizer
from backend_lib.llm.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import Scheduler, SchedulerOutput, check_prompt_fits
from backend_lib.llm.core.sequence import Sequence, SequenceStatus
from backend_lib.llm.core.stats import EngineStats, FinishedRequest, StatsCollector
from backend_lib.llm.execution.loader import read_checkpoint_info
from backend_lib.llm.execution.model_runner import ModelOutput, ModelRunner
from backend_lib.llm.execution.sampler import TokenLogprobs
from backend_lib.llm.lora.registry import LORA_DISABLED_ERROR, LoRARegistry
from backend_lib.llm.lora.request import LoRARequest
from backend_lib.llm.structured.compiler import GrammarCompiler
from backend_lib.llm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_SEED_MODULUS = 2**64  # child i of a seeded request uses (seed + i) mod 2**64


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for `LLMEngine.add_prepared`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    grammar: xgr.CompiledGrammar | None = None
    """params.structured_outputs compiled for this engine's tokenizer (None: unconstrained)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model)."""


@dataclass(eq=False)
class _SeqState:
    """Engine-side state of one sequence: its text stream and what was already sent."""

    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    text: str = ""
    """Text released to the client so far (never a held-back partial stop string)."""
    delta_text: str = ""
    num_sent_tokens: int = 0
    last_token_time: float | None = None


@dataclass(eq=False)
class _Request:
    prepared: PreparedRequest
    metrics: RequestMetrics
    seqs: list[_SeqState] = field(default_factory=list)
    forked: bool = False
    error: str | None = None
    final_only: bool = False
    """Only the final output is wanted (`generate`, as vLLM's FINAL_ONLY): steps build none before."""

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.seqs)


class LLMEngine:
    """Continuous-batching generation over one model replica (see module docstring)."""

    def __init__(
        self,
        config: LLMConfig,
        model_dir: str | Path,
        device: torch.device,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lora_modules: Mapping[str, str | Path] | None = None,
    ) -> None:
        """Load the checkpoint in `model_dir` (already resolved; see `from_config`) on `device`.
        Request limits (max_n, max_logprobs, max_queue_size, ...) all come from `config`.
        `lora_modules`: adapter name -> PEFT adapter directory (needs `config.enable_lora`)."""
        self.config = config
        self.device = torch.device(device)
        checkpoint = read_checkpoint_info(model_dir)
        self.runner = ModelRunner(config, self.device, checkpoint)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.model.args.vocab_size
        require(
            config.max_logprobs <= self.vocab_size,
            "max_logprobs",
            config.max_logprobs,
            f"exceeds the checkpoint's vocabulary ({self.vocab_size} tokens)",
        )
        self.scheduler = Scheduler(
            config,
            self.runner.num_blocks,
            self.runner.num_host_blocks,
            self.max_model_len,
            checkpoint.eos_token_ids,
        )
        # transformers may reconfigure the Rust tokenizer inside a call (truncation, padding);
        # concurrent callers of prepare_request must not interleave there.
        self._tokenizer_lock = threading.Lock()
        self.fault_injector: Callable[[str], None] | None = None
        """Test hook: called with each request id processed in a step; raising fails that request."""
        self._requests: dict[str, _Request] = {}
        self._seq_states: dict[int, _SeqState] = {}
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._stats = StatsCollector()
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.vocab_size, checkpoint.eos_token_ids
        )
        self.structured = StructuredOutputManager(self.vocab_size)
        require(
            config.enable_lora or not lora_modules,
            "enable_lora",
            config.enable_lora,
            "LoRA adapters are listed, but enable_lora is off",
        )
        self.lora_registry = (
            LoRARegistry(
                lora_modules or {},
                self.runner.lora_spec,
                config.max_lora_rank,
                config.cpu_lora_capacity,
            )
            if config.enable_lora
            else None
        )
        """The servable adapters (None: LoRA disabled)."""

    @classmethod
    def from_config(
        cls,
        config: LLMConfig,
        base_dir: str | Path,
        device: torch.device,
        lora_modules: Mapping[str, str | Path] | None = None,
    ) -> LLMEngine:
        """Engine on the checkpoint `config.model` (resolved against `base_dir`)."""
        model_dir = resolve_model_path(config.model, Path(base_dir))
        return cls(config, model_dir, device, lora_modules=lora_modules)

    # --- requests ----------------------------------------------------------------------------

    def prepare_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: Seq[int] | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize without touching engine state (safe from any thread).

        Raises InputError for bad parameters (a structured_outputs constraint that does not
        compile included), an empty prompt, token ids outside the vocabulary, a prompt that
        leaves no room for output within max_model_len, or a `lora_name` that cannot be served
        (LoRA disabled, unknown name, bad adapter directory; loads the adapter otherwise).
        """
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if not isinstance(request_id, str) or not request_id:
            raise InputError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(max_logprobs=self.config.max_logprobs, max_n=self.config.max_n)
        self._check_token_ids("stop_token_ids", params.stop_token_ids or [])
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            self._check_token_ids("prompt_token_ids", ids)
        elif isinstance(prompt, str):
            ids = self._tokenize(prompt) if prompt else []
        else:
            raise InputError(f"prompt must be a string, got {type(prompt).__name__}")
        if not ids:
            raise InputError("the prompt is empty")
        check_prompt_fits(len(ids), self.max_model_len)
        lora_request = self.resolve_lora(lora_name)
        grammar = None
        if params.structured_outputs is not None:
            grammar, seconds = self.grammar_compiler.compile(params.structured_outputs)
            if seconds is not None:
                self._stats.grammar_compiled(seconds)
        return PreparedRequest(request_id, prompt, ids, params, arrival_time, grammar, lora_request)

    def resolve_lora(self, lora_name: str | None) -> LoRARequest | None:
        """The loaded adapter `lora_name` (None: the base model); InputError with the vLLM
        backend's messages when LoRA is off or the name unknown, or when it cannot be loaded."""
        if lora_name is None:
            return None
        if not isinstance(lora_name, str):
            raise InputError(f"lora_name must be a string, got {lora_name!r}")
        if self.lora_registry is None:
            raise InputError(LORA_DISABLED_ERROR)
        return self.lora_registry.request(lora_name)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request. Raises InputError (duplicate id) or QueueFullError."""
        if prepared.request_id in self._requests:
            raise InputError(f"request id {prepared.request_id!r} is already running")
        seq = Sequence(
            next(self._seq_ids),
            prepared.request_id,
            list(prepared.prompt_token_ids),
            len(prepared.prompt_token_ids),
            prepared.params,
            prepared.arrival_time,
            lora_request=prepared.lora_request,
        )
        state = self._new_seq_state(seq, 0)
        self.scheduler.add(seq)
        if prepared.grammar is not None:
            self.structured.add(seq.seq_id, prepared.grammar)
            self._stats.constrained_requests += 1
        if prepared.lora_request is not None:
            self._stats.lora_request(prepared.lora_request.lora_name)
        request = _Request(prepared, RequestMetrics(prepared.arrival_time))
        self._track(request, state)
        self._requests[prepared.request_id] = request

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: Seq[int] | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Validate, tokenize (unless `prompt_token_ids` is given) and queue a request."""
        self.add_prepared(
            self.prepare_request(
                request_id, prompt, params, prompt_token_ids, arrival_time, lora_name
            )
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now with reason "abort", freeing its blocks; returns its final
        output (None when the id is unknown or already finished)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        for state in request.seqs:
            if not state.seq.is_finished:
                self.scheduler.finish(state.seq, "abort")
        return self._finish(request)

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """Like `abort_request`, but the request finishes with reason "error" and `error`."""
        request = self._requests.get(request_id)
        return None if request is None else self._fail(request, error)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        """Gauges and counters now, plus the observations since the previous call (drained)."""
        return self._stats.snapshot(self.scheduler.stats)

    # --- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of every request that produced tokens or finished."""
        sched_out = self.scheduler.schedule()
        now = time.monotonic()
        for item in sched_out.scheduled:
            metrics = self._requests[item.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        num_samples = self._num_samples(sched_out)
        failed: list[RequestOutput] = []
        try:
            model_out = self.runner.execute(sched_out, num_samples or None, self.structured)
            if model_out.bitmask is not None:
                self._stats.bitmask_filled(model_out.bitmask.fill_seconds)
                for seq_id in model_out.bitmask.dead_seq_ids:
                    error = "structured_outputs: the grammar allows no next token (dead end)"
                    request_id = self._seq_states[seq_id].seq.request_id
                    failed += self._fail_constrained(request_id, error, model_out, num_samples)
            sampled, forks = self._split_samples(model_out, num_samples)
            self.scheduler.update(sched_out, sampled, forks)
            for request_id, error in self._advance_grammars(sched_out, sampled, forks).items():
                failed += self._fail_constrained(request_id, error, model_out, num_samples)
        except Exception as exc:
            logger.exception("engine step failed; failing the requests of this step")
            return failed + self._fail_step(sched_out, exc)
        return failed + self._process_tokens(sched_out, model_out, forks, time.monotonic())

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        lora_names: Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (texts or token id lists) to completion; final outputs in order.
        `lora_names`: each prompt's adapter (None: the base model)."""
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        loras = [None] * len(prompts) if lora_names is None else list(lora_names)
        if len(loras) != len(prompts):
            raise ValueError("need one lora name (or None) per prompt")
        request_ids: list[str] = []
        try:
            for prompt, sp, lora in zip(prompts, params_list, loras, strict=True):
                request_id = f"generate-{next(self._generate_ids)}"
                if isinstance(prompt, str):
                    self.add_request(request_id, prompt, sp, lora_name=lora)
                else:
                    self.add_request(request_id, None, sp, prompt_token_ids=prompt, lora_name=lora)
                request_ids.append(request_id)
                self._requests[request_id].final_only = True
        except Exception:  # all or nothing: a bad prompt (or a full queue) adds none
            for request_id in request_ids:
                self.abort_request(request_id)
            raise
        finals: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        while len(finals) < len(request_ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    finals[out.request_id] = out
        return [finals[r] for r in request_ids]

    # --- step internals ----------------------------------------------------------------------

    def _num_samples(self, sched_out: SchedulerOutput) -> dict[int, int]:
        """n for each n > 1 parent sampling its very first token (children are forked then)."""
        result = {}
        for item in sched_out.scheduled:
            seq = item.seq
            n = seq.sampling_params.n
            if (
                n > 1
                and item.samples
                and seq.num_output_tokens == 0
                and not self._requests[seq.request_id].forked
            ):
                result[seq.seq_id] = n
        return result

    def _split_samples(
        self, model_out: ModelOutput, num_samples: dict[int, int]
    ) -> tuple[dict[int, list[int]], dict[int, list[Sequence]]]:
        """The parent keeps its first sample; each other sample starts a child sequence."""
        sampled = dict(model_out.sampled)
        forks: dict[int, list[Sequence]] = {}
        for parent_id in num_samples:
            tokens = model_out.sampled[parent_id]
            sampled[parent_id] = tokens[:1]
            parent = self._seq_states[parent_id].seq
            forks[parent_id] = [
                self._child(parent, i, token) for i, token in enumerate(tokens[1:], start=1)
            ]
        return sampled, forks

    def _advance_grammars(
        self,
        sched_out: SchedulerOutput,
        sampled: dict[int, list[int]],
        forks: dict[int, list[Sequence]],
    ) -> dict[str, str]:
        """Advance each constrained sequence's matcher by its new token (a new child starts from
        its parent's state); finish those whose grammar terminated with "stop". Returns
        request_id -> error for tokens the grammar refuses (sampled from a fully masked row)."""
        errors: dict[str, str] = {}
        if not len(self.structured):
            return errors
        for item in sched_out.scheduled:
            seq = item.seq
            if seq.seq_id not in sampled or seq.seq_id not in self.structured:
                continue
            for child in forks.get(seq.seq_id, ()):
                self.structured.fork(seq.seq_id, child.seq_id)
                self._accept_grammar(child, errors)
            self._accept_grammar(seq, errors)
        return errors

    def _accept_grammar(self, seq: Sequence, errors: dict[str, str]) -> None:
        token = seq.last_token_id
        allowed, terminated = self.structured.accept(seq.seq_id, token)
        if not allowed:
            errors[seq.request_id] = (
                f"structured_outputs: the grammar allows no token here (token {token} was "
                "sampled from a fully masked row; e.g. min_tokens banned EOS where only EOS fits)"
            )
        elif terminated and not seq.is_finished:
            self.scheduler.finish(seq, "stop")

    def _fail_constrained(
        self, request_id: str, error: str, model_out: ModelOutput, num_samples: dict[int, int]
    ) -> list[RequestOutput]:
        """Fail the request now; its sequences' tokens of this step are dropped."""
        request = self._requests.get(request_id)
        if request is None:
            return []  # already failed this step (a sibling)
        for s in request.seqs:
            model_out.sampled.pop(s.seq.seq_id, None)
            model_out.logprobs.pop(s.seq.seq_id, None)
            num_samples.pop(s.seq.seq_id, None)
        return [self._fail(request, error)]

    def _child(self, parent: Sequence, index: int, first_token: int) -> Sequence:
        params = parent.sampling_params
        child = Sequence(
            next(self._seq_ids),
            parent.request_id,
            parent.prompt_token_ids + [first_token],
            parent.num_prompt_tokens,
            params,
            parent.arrival_time,
            lora_request=parent.lora_request,
        )
        if params.seed is not None:
            # Its own stream, as the runner seeds a parent's, so siblings are not correlated.
            child.generator = torch.Generator(device=self.device)
            child.generator.manual_seed((params.seed + index) % _SEED_MODULUS)
        return child

    def _process_tokens(
        self,
        sched_out: SchedulerOutput,
        model_out: ModelOutput,
        forks: dict[int, list[Sequence]],
        now: float,
    ) -> list[RequestOutput]:
        """Record each new token (logprobs, text, stop strings, latencies); build outputs."""
        # request_id -> [(sequence, logprobs of its new token)] in scheduling order; a parent's
        # new children follow it.
        new_tokens: dict[str, list[tuple[Sequence, TokenLogprobs | None]]] = {}
        for item in sched_out.scheduled:
            seq = item.seq
            if seq.seq_id not in model_out.sampled:
                continue
            seqs = [seq, *forks.get(seq.seq_id, ())]
            logprobs = model_out.logprobs.get(seq.seq_id) or [None] * len(seqs)
            new_tokens.setdefault(seq.request_id, []).extend(zip(seqs, logprobs, strict=True))
        outputs = []
        for request_id, entries in new_tokens.items():
            request = self._requests[request_id]
            try:
                if self.fault_injector is not None:
                    self.fault_injector(request_id)
                self._record_tokens(request, entries, now)
            except Exception as exc:
                logger.exception("request %s failed", request_id)
                outputs.append(self._fail(request, _describe(exc)))
                continue
            if request.finished:
                outputs.append(self._finish(request))
            elif not request.final_only:
                outputs.append(self._output(request))
        return outputs

    def _record_tokens(
        self, request: _Request, entries: list[tuple[Sequence, TokenLogprobs | None]], now: float
    ) -> None:
        latencies = []
        for seq, logprobs in entries:
            state = self._seq_states.get(seq.seq_id)
            if state is None:  # a child forked in this step
                state = self._track(request, self._new_seq_state(seq, len(request.seqs)))
                request.forked = True
            if logprobs is not None and state.logprobs is not None:
                entry = {
                    token: Logprob(value, rank)
                    for rank, (token, value) in enumerate(
                        zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True), start=1
                    )
                }
                entry[logprobs.token_id] = Logprob(logprobs.logprob, logprobs.rank)
                state.logprobs.append(entry)
                state.cumulative_logprob += logprobs.logprob
            delta = ""
            if self._shows_last_token(seq):
                delta, stop_hit = state.detok.add(seq.last_token_id)
                if stop_hit:
                    self.scheduler.finish(seq, "stop", stop_reason=state.detok.stop_string)
            if seq.is_finished:
                delta += state.detok.flush()
            state.text += delta
            state.delta_text += delta
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
        self._stats.tokens(len(entries), latencies)

    @staticmethod
    def _shows_last_token(seq: Sequence) -> bool:
        """vLLM hides the text of the EOS / stop token that ended a sequence, unless asked."""
        stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        return not stopped_by_token or seq.sampling_params.include_stop_str_in_output

    def _fail_step(self, sched_out: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """Fail the step's requests, including those swapped out by it (their host copy may be
        incomplete)."""
        seqs = [item.seq for item in sched_out.scheduled]
        seqs += [s for s in sched_out.preempted if s.status is SequenceStatus.SWAPPED]
        request_ids = dict.fromkeys(s.request_id for s in seqs)
        return [
            self._fail(self._requests[r], _describe(exc))
            for r in request_ids
            if r in self._requests
        ]

    def _fail(self, request: _Request, error: str) -> RequestOutput:
        request.error = error
        for state in request.seqs:
            self.scheduler.finish(state.seq, "error")  # on a finished one: only the reason changes
        # Children forked in a step that failed before the engine tracked them.
        for seq in self.scheduler.abort(request.prepared.request_id):
            self.structured.remove(seq.seq_id)
        return self._finish(request)

    # --- outputs -----------------------------------------------------------------------------

    def _new_seq_state(self, seq: Sequence, index: int) -> _SeqState:
        params = seq.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params)
        return _SeqState(seq, index, detok, [] if params.logprobs is not None else None)

    def _track(self, request: _Request, state: _SeqState) -> _SeqState:
        request.seqs.append(state)
        self._seq_states[state.seq.seq_id] = state
        return state

    def _finish(self, request: _Request) -> RequestOutput:
        """Final output of a request whose sequences are all finished; forgets the request."""
        metrics = request.metrics
        metrics.finished_time = time.monotonic()
        del self._requests[request.prepared.request_id]
        for state in request.seqs:
            del self._seq_states[state.seq.seq_id]
            self.structured.remove(state.seq.seq_id)
        params = request.prepared.params
        first = metrics.first_token_time
        self._stats.finished(
            FinishedRequest(
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
            )
        )
        return self._output(request)

    def _output(self, request: _Request) -> RequestOutput:
        prepared = request.prepared
        return RequestOutput(
            request_id=prepared.request_id,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,  # never mutated: shared, not copied
            outputs=[self._completion(s) for s in request.seqs],
            finished=request.finished,
            num_cached_tokens=request.seqs[0].seq.num_cached_prompt_tokens,
            metrics=dataclasses.replace(request.metrics),
            error=request.error,
        )

    @staticmethod
    def _completion(state: _SeqState) -> CompletionOutput:
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

    def _tokenize(self, prompt: str) -> list[int]:
        """Token ids exactly as `AutoTokenizer(prompt).input_ids` (special tokens such as BOS
        added the checkpoint's way)."""
        with self._tokenizer_lock:
            return self.tokenizer(prompt)["input_ids"]

    def _check_token_ids(self, name: str, ids: list[int]) -> None:
        for token in ids:
            if (
                not isinstance(token, int)
                or isinstance(token, bool)
                or not 0 <= token < self.vocab_size
            ):
                raise InputError(
                    f"{name} must hold token ids in [0, {self.vocab_size}), got {token!r}"
                )


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's fast tokenizer, configured as HF configures it (BOS and all)."""
    return AutoTokenizer.from_pretrained(str(model_dir), **HF_OFFLINE_KWARGS)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
