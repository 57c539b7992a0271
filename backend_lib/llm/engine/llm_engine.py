"""LLMEngine: synchronous, step-based generation over one model replica.

Three jobs, three units: the `InputProcessor` validates and tokenizes a request on the caller's
thread; `step()` schedules, executes and updates; the `OutputProcessor` turns the new tokens into
text and `RequestOutput`s. Not thread-safe apart from `prepare_request`: one thread drives the
engine (serving/engine_loop.py).

Failures are contained: an exception tied to one request (detokenization, the fault-injection
seam) fails only that request; an exception in the forward (or anywhere in execute/update)
fails every request of that step. Failed requests finish with reason "error", the message in
`RequestOutput.error`, and their KV blocks freed; the engine keeps serving the others.

Structured outputs: the constraint is compiled in a worker process (structured/compiler.py). A
request whose grammar is not ready when it is added waits outside the scheduler, holding no
batch slot or KV block but counting toward max_queue_size; every `step()` polls the held
requests (it never waits on a compile) and queues those whose grammar is ready, or fails those
whose constraint did not compile. `on_grammar_ready` tells the driving thread that one finished.
Each constrained sequence keeps an xgrammar matcher (structured/), whose next-token bitmask the
runner fills during the forward and applies before sampling (grammar_step.py advances it after).
LoRA: a request names its adapter with `lora_name`, resolved through the LoRARegistry while it
is prepared; the scheduler keeps at most max_loras adapters running; the runner maps rows to
adapter slots.
Speculative decoding (`speculative_config`): before each step the Drafter proposes draft tokens
for the running decodes (engine/drafter.py), the scheduler fits them in the step, the runner
computes their logits, the Drafter verifies them (spec_decode/verifier.py) and a sequence then
advances by its accepted drafts plus one token.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from backend_lib.checkpoint import load_tokenizer, resolve_model_path
from backend_lib.config import require
from backend_lib.contract import ErrorCode
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.outputs import RequestOutput
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import Scheduler
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.core.stats import EngineStats, StatsCollector
from backend_lib.llm.core.tenants import read_tenant_weights
from backend_lib.llm.engine import offline
from backend_lib.llm.engine.deadlines import Deadlines
from backend_lib.llm.engine.drafter import Drafter
from backend_lib.llm.engine.fault_injection import FaultHook
from backend_lib.llm.engine.grammar_step import (
    advance_grammars,
    fail_constrained,
    fail_dead_ends,
)
from backend_lib.llm.engine.grammar_wait import GrammarWait
from backend_lib.llm.engine.input_processor import InputProcessor, PreparedRequest
from backend_lib.llm.engine.mm_processor import image_processor_for
from backend_lib.llm.engine.offload_steps import (
    absorb_tier_report,
    flush_to_disk,
    offloader_for,
    tier_stats,
)
from backend_lib.llm.engine.output_processor import OutputProcessor
from backend_lib.llm.engine.parallel_sampling import ParallelSampling
from backend_lib.llm.engine.step_interrupts import StepInterrupts
from backend_lib.llm.execution.loader import read_checkpoint_info
from backend_lib.llm.execution.model_runner import ModelRunner
from backend_lib.llm.execution.step_interrupt import StepInterrupted
from backend_lib.llm.execution.workers import WorkerDied
from backend_lib.llm.kv_offload_config import KVOffloadConfig
from backend_lib.llm.lora.registry import LoRARegistry
from backend_lib.llm.lora.request import LoRARequest
from backend_lib.llm.spec_decode.draft_model import draft_model_loader
from backend_lib.llm.structured.compiler import GrammarCompiler
from backend_lib.llm.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation over one model replica (see module docstring)."""

    def __init__(
        self,
        config: LLMConfig,
        model_dir: str | Path,
        device: torch.device,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lora_modules: Mapping[str, str | Path] | None = None,
        base_dir: str | Path | None = None,
    ) -> None:
        """Load the checkpoint in `model_dir` (already resolved; see `from_config`) on `device`.
        Request limits (max_n, max_logprobs, max_queue_size, ...) all come from `config`.
        `lora_modules`: adapter name -> PEFT adapter directory (needs `config.enable_lora`).
        `base_dir`: what a relative draft model path (speculative_config.model) is resolved
        against (default: the working directory), and the `tenant_weights` file too."""
        self.config = config
        tenant_weights = _tenant_weights(config, base_dir)  # a bad file fails before loading
        self.device = torch.device(device)
        checkpoint = read_checkpoint_info(model_dir)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        draft = draft_model_loader(config.speculative, checkpoint, self.tokenizer, base_dir)
        offload = KVOffloadConfig.of(config, Path(base_dir or "."))  # a bad path fails first
        if offload is not None and offload.path is not None:  # the workers resolve it alike
            config = self.config = dataclasses.replace(
                config, kv_offloading_path=str(offload.path.resolve())
            )
        self.runner = ModelRunner(config, self.device, checkpoint, draft, offload)
        self.fatal_error: WorkerDied | None = None
        """Set when a step failed in a way no later step recovers from: a worker process (another
        rank) died, so the model's shard it held is gone."""
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
            tenant_weights,
            offloader_for(self.runner.offload, config.block_size),
        )
        self._stats = StatsCollector()
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer,
            self.vocab_size,
            checkpoint.eos_token_ids,
            timeout_s=config.structured_outputs_compile_timeout_s,
            on_compiled=self._stats.grammar_compiled,
        )
        self.structured = StructuredOutputManager(self.vocab_size)
        self.lora_registry = self._lora_registry(lora_modules)
        """The servable adapters (None: LoRA disabled)."""
        self.inputs = InputProcessor(
            config,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.grammar_compiler,
            self.lora_registry,
            image_processor_for(self.runner.model, checkpoint.model_dir, self.tokenizer, config),
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.structured, self._stats)
        self._seq_ids = itertools.count()
        self.sampling = ParallelSampling(self.device, self._seq_ids)
        self.grammar_wait = GrammarWait(self._stats)
        """Requests waiting for their grammar, outside the scheduler (grammar_wait.py)."""
        self.deadlines = Deadlines(config.max_queue_wait_ms)
        speculative = config.speculative
        self.drafter = None
        if speculative is not None:
            self.drafter = Drafter(speculative, self.max_model_len, self.runner.draft)
        """Speculative decoding's proposer (None: no speculative_config)."""
        self.interrupts = StepInterrupts.of(config, self.scheduler.order, self.runner, self.drafter)
        """When a step yields to an arrival (engine/step_interrupts.py)."""

    @classmethod
    def from_config(
        cls,
        config: LLMConfig,
        base_dir: str | Path,
        device: torch.device,
        lora_modules: Mapping[str, str | Path] | None = None,
    ) -> LLMEngine:
        """Engine on the checkpoint `config.model` (resolved against `base_dir`)."""
        model_dir = resolve_model_path(config.model, Path(base_dir), config.gguf_file)
        return cls(config, model_dir, device, lora_modules=lora_modules, base_dir=base_dir)

    def _lora_registry(self, lora_modules: Mapping[str, str | Path] | None) -> LoRARegistry | None:
        config = self.config
        require(
            config.enable_lora or not lora_modules,
            "enable_lora",
            config.enable_lora,
            "LoRA adapters are listed, but enable_lora is off",
        )
        if not config.enable_lora:
            return None
        return LoRARegistry(
            lora_modules or {},
            self.runner.lora_spec,
            config.max_lora_rank,
            config.cpu_lora_capacity,
        )

    @property
    def fault_injector(self) -> FaultHook | None:
        """The fault-injection seam (engine/fault_injection.py; TEST-ONLY)."""
        return self.outputs.fault_hook

    @fault_injector.setter
    def fault_injector(self, hook: FaultHook | None) -> None:
        self.outputs.fault_hook = hook

    # --- requests ----------------------------------------------------------------------------

    def prepare_request(
        self, request: EngineRequest, grammar_wait: float | None = None
    ) -> PreparedRequest:
        """Validate and tokenize without touching engine state (safe from any thread);
        InputError for a bad request (see `InputProcessor.prepare`). A constraint is waited for
        at most `grammar_wait` seconds (None: until compiled)."""
        return self.inputs.prepare(request, grammar_wait)

    def resolve_lora(self, lora_name: str | None) -> LoRARequest | None:
        return self.inputs.resolve_lora(lora_name)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request, or hold it while its grammar compiles. Raises InputError
        (duplicate id) or QueueFullError (held requests count as waiting)."""
        request_id = prepared.request_id
        if request_id in self.outputs.requests or request_id in self.grammar_wait:
            raise InputError(f"request id {request_id!r} is already running")
        self._check_queue(prepared.request.tenant_key)
        if prepared.grammar_job is None:
            self._queue(prepared)
        else:
            self.grammar_wait.hold(prepared)
        self.deadlines.watch(prepared.request)

    @property
    def on_grammar_ready(self) -> Callable[[], None] | None:
        """Called, on a compile thread, when a held request's grammar is done (grammar_wait.py)."""
        return self.grammar_wait.on_ready

    @on_grammar_ready.setter
    def on_grammar_ready(self, callback: Callable[[], None] | None) -> None:
        self.grammar_wait.on_ready = callback

    def _check_queue(self, tenant: str) -> None:
        waiting = len(self.scheduler.waiting) + len(self.grammar_wait)
        limit = self.config.max_queue_size
        if waiting >= limit:
            raise QueueFullError(f"queue full: {waiting} requests waiting (max_queue_size={limit})")
        self.scheduler.check_tenant_queue(tenant)

    def _queue(self, prepared: PreparedRequest) -> None:
        """Into the scheduler's waiting queue (QueueFullError from the scheduler)."""
        seq = Sequence(
            next(self._seq_ids),
            prepared.request_id,
            list(prepared.prompt_token_ids),
            len(prepared.prompt_token_ids),
            prepared.params,
            prepared.arrival_time,
            lora_request=prepared.lora_request,
            request=prepared.request,
        )
        self.scheduler.add(seq)
        if prepared.grammar is not None:
            self.structured.add(seq.seq_id, prepared.grammar)
            self._stats.constrained_requests += 1
        if prepared.lora_request is not None:
            self._stats.lora_request(prepared.lora_request.lora_name)
        self.outputs.add(prepared, seq)

    def add(self, request: EngineRequest) -> None:
        """Validate, tokenize (unless it has `prompt_token_ids`) and queue a request; a
        constraint is waited for (compiled in a worker), so a bad one is an InputError here."""
        self.add_prepared(self.prepare_request(request))

    def add_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, **fields
    ) -> None:
        """`add` of `EngineRequest(request_id, prompt, params, **fields)` (vLLM's call)."""
        self.add(EngineRequest(request_id, prompt, params, **fields))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish the request now with reason "abort", freeing its blocks; returns its final
        output (None when the id is unknown or already finished)."""
        if request_id in self.grammar_wait:
            return self.grammar_wait.release(request_id, "abort", None)
        request = self.outputs.requests.get(request_id)
        if request is None:
            return None
        for state in request.seqs:
            if not state.seq.is_finished:
                self.scheduler.finish(state.seq, "abort")
        return self.outputs.finish(request)

    def fail_request(
        self, request_id: str, error: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> RequestOutput | None:
        """Like `abort_request`, but the request finishes with reason "error", `error` and its
        `code`."""
        if request_id in self.grammar_wait:
            return self.grammar_wait.release(request_id, "error", error, code)
        request = self.outputs.requests.get(request_id)
        return None if request is None else self.outputs.fail(request, error, code)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests or len(self.grammar_wait))

    def needs_step(self) -> bool:
        """Whether `step()` has work now: requests in the scheduler, a held request whose grammar
        is done, or a deadline due. False while the only unfinished requests wait for their
        grammar (until `seconds_to_next_due`)."""
        return (
            self.scheduler.has_unfinished()
            or self.grammar_wait.any_ready()
            or self.seconds_to_next_due() == 0.0
        )

    def seconds_to_next_due(self) -> float | None:
        """How long until a request's deadline or queue wait is due (0: now; None: none)."""
        due = self.deadlines.next_due()
        return None if due is None else max(0.0, due - time.monotonic())

    @property
    def num_held(self) -> int:
        """Requests waiting for their grammar outside the scheduler."""
        return len(self.grammar_wait)

    def stats(self) -> EngineStats:
        """Gauges and counters now, plus the observations since the previous call (drained).
        Requests waiting for their grammar count as waiting (as vLLM's WAITING_FOR_FSM)."""
        stats = self._stats.snapshot(self.scheduler.stats, self.scheduler.tenants.take_tokens())
        stats.counters = dataclasses.replace(
            stats.counters, steps_interrupted=self.interrupts.count
        )
        stats.num_waiting_for_grammar = len(self.grammar_wait)
        stats.num_waiting += stats.num_waiting_for_grammar
        if self.runner.offload is not None:
            stats.kv_offload = tier_stats(self.runner.offload, self.scheduler)
        return stats

    def close(self) -> None:
        """Release the grammar compile workers (the last engine on them stops them, failing the
        constraints still compiling), the bitmask thread and any tensor-parallel workers; abort
        held requests first. A disk tier first gets the prefix cache's blocks it lacks."""
        self.grammar_compiler.close()
        self.structured.close()
        if self.runner.offload is not None and self.fatal_error is None:
            try:
                flush_to_disk(self.runner, self.scheduler)
            except Exception:  # closing must go on: the tier is a cache
                logger.exception("writing the prefix cache to the disk tier at close failed")
        self.runner.close()

    # --- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: queue the held requests whose grammar is ready, then schedule -> execute ->
        update -> process outputs. Returns the outputs of every request that produced tokens or
        finished (held ones whose constraint failed to compile included)."""
        ended = self.expire()
        admitted = self.grammar_wait.admit_ready(self._queue) if len(self.grammar_wait) else []
        if not self.scheduler.has_unfinished():
            return ended + admitted
        return ended + admitted + self._step()

    def expire(self) -> list[RequestOutput]:
        """End the requests past their deadline or queue wait (engine/deadlines.py); `step` does
        first, a driving loop may before it to answer them without waiting for the step."""
        if self.seconds_to_next_due() != 0.0:
            return []
        ended = self.deadlines.expire(time.monotonic(), self._was_admitted)
        outputs = (self.fail_request(e.request_id, e.message, e.code) for e in ended)
        return [output for output in outputs if output is not None]

    def _was_admitted(self, request_id: str, arrival_time: float) -> bool | None:
        """Whether the unfinished request of this id and arrival was ever scheduled; None when
        there is none."""
        held = self.grammar_wait.get(request_id)
        if held is not None:
            return False if held.arrival_time == arrival_time else None
        request = self.outputs.requests.get(request_id)
        if request is None or request.metrics.arrival_time != arrival_time:
            return None
        return request.metrics.first_scheduled_time is not None

    def _step(self) -> list[RequestOutput]:
        if self.runner.offload is not None:
            absorb_tier_report(self.runner, self.scheduler)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, self.structured)
        sched_out = self.scheduler.schedule()
        self.outputs.mark_scheduled(sched_out, time.monotonic())
        samples_due = self.sampling.samples_due(sched_out, self.outputs.is_forked)
        free_slots = self.config.max_num_seqs - len(self.scheduler.running)
        interrupt = self.interrupts.interrupt_for(sched_out, free_slots)
        failed: list[RequestOutput] = []
        interrupted = False
        try:
            model_out = self.runner.execute(
                sched_out, samples_due or None, self.structured, interrupt
            )
            if self.drafter is not None:
                self.drafter.verify(model_out, self.runner.sampler)
            self.outputs.record_prompt_logprobs(model_out.prompt_logprobs)
            self._stats.drafts_verified(model_out.drafts.values())
            failed += fail_dead_ends(self.outputs, self._stats, model_out, samples_due)
            sampled, forks = self.sampling.split(sched_out, model_out, samples_due)
            self.scheduler.update(sched_out, sampled, forks)
            errors = advance_grammars(self.structured, self.scheduler, sched_out, sampled, forks)
            for request_id, error in errors.items():
                failed += fail_constrained(self.outputs, request_id, error, model_out, samples_due)
        except StepInterrupted:  # dropped as if never run: the next step takes it up
            interrupted = True
        except Exception as exc:
            logger.exception("engine step failed; failing the requests of this step")
            if isinstance(exc, WorkerDied):
                self.fatal_error = exc
            if self.runner.offload is not None:  # its tier copies may not have run
                self.scheduler.kv_cache_manager.offload.forget(sched_out.offload)
            failed += self.outputs.fail_step(sched_out, exc)
        else:
            failed += self.outputs.process(sched_out, model_out, forks, time.monotonic())
        finally:
            self.interrupts.completed(interrupted)
            if self.drafter is not None:  # the draft model's cache of finished sequences
                self.drafter.retain(self.scheduler.running)
        return failed

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        lora_names: Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (texts or token id lists) to completion; final outputs in order
        (engine/offline.py). `lora_names`: each prompt's adapter (None: the base model)."""
        return offline.generate(self, prompts, params, lora_names)


def _tenant_weights(config: LLMConfig, base_dir: str | Path | None) -> dict[str, float] | None:
    """The `tenant_weights` file's weights (relative to `base_dir`); None without one."""
    if not config.tenant_weights:
        return None
    return read_tenant_weights(Path(base_dir or ".") / config.tenant_weights)
