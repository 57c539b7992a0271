"""Constraint -> xgrammar CompiledGrammar, one compiler per tokenizer, grammars cached by text.

`submit` is the serving path: a cached grammar comes back at once, otherwise the constraint is
compiled in a worker process (compile_worker.py), so a costly compile (seconds for some schema
`pattern`s) holds neither the submitting thread nor the engine step nor the GIL; identical
constraints submitted while one compiles share that compile, and a compile past `timeout_s`
is stopped (its worker killed). `compile` compiles in the calling thread (tools, benchmarks).
Both fill the same LRU cache, keyed by the constraint's canonical text
(`StructuredOutputsParams.cache_key`).

Nothing is built before the first constrained request (the tokenizer's xgrammar vocabulary
table, the worker processes), so an engine that never sees one pays nothing. Compile errors of
every kind (a schema xgrammar rejects, a bad regex, an EBNF syntax error, a timeout) become
InputError naming the field.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from backend_lib.errors import InputError
from backend_lib.llm.structured.compile_worker import (
    DEFAULT_WORKERS,
    CompileError,
    CompileTimeout,
    CompileWorkers,
    acquire_pool,
    clean_error,
    compile_constraint,
    release_pool,
)
from backend_lib.llm.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
DEFAULT_TIMEOUT_S = 10.0
"""CPU seconds a worker may spend on one constraint (LLMConfig.structured_outputs_compile_timeout_s)."""
_EXCERPT = 60


class GrammarJob:
    """One request's constraint being compiled (or already compiled): the engine holds the
    request until `done()`, then takes `result()`."""

    def __init__(self, spec: StructuredOutputsParams, future: Future):
        self.spec = spec
        self._future = future

    @property
    def future(self) -> Future:
        """Its future: the CompiledGrammar, or the InputError (shared by identical requests)."""
        return self._future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: until done); whether it is done."""
        if timeout is not None and timeout <= 0:
            return self._future.done()
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def result(self) -> xgr.CompiledGrammar:
        """The grammar (waits for it); InputError naming the constraint when it failed."""
        return self._future.result()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """`fn()` once done, on the thread that completes it (at once if done already)."""
        self._future.add_done_callback(lambda _: fn())


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer; thread-safe (submitting threads)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_workers: int = DEFAULT_WORKERS,
        on_compiled: Callable[[float], None] | None = None,
    ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's); `stop_token_ids`:
        the tokens that end a sequence (EOS), allowed only where the grammar can end;
        `timeout_s`: most seconds a worker spends on one constraint; `max_workers`: compile
        processes; `on_compiled(seconds)`: called once per grammar compiled (not on cache hits),
        from the thread that finished it."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.on_compiled = on_compiled
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._workers: CompileWorkers | None = None
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def workers(self) -> CompileWorkers | None:
        """The worker pool (None before the first compile submitted)."""
        return self._workers

    def submit(self, spec: StructuredOutputsParams) -> GrammarJob:
        """Start compiling `spec` in a worker (never blocks on a compile): a job already done
        on a cache hit, the running compile's job when the same constraint is in flight."""
        key = spec.cache_key
        with self._lock:
            grammar = self._cached(key)
            if grammar is not None:
                done: Future = Future()
                done.set_result(grammar)
                return GrammarJob(spec, done)
            future = self._inflight.get(key)
            if future is not None:
                return GrammarJob(spec, future)
            if self._closed:
                raise InputError(f"structured_outputs.{spec.kind}: the engine is shut down")
            if self._workers is None:
                self._workers = acquire_pool(self._tokenizer_info(), self.max_workers)
            workers = self._workers
            future = self._inflight[key] = Future()
        # Outside the lock: a pool that is closing completes `started` (and so calls back) at once.
        started = workers.submit(key, self.timeout_s)
        started.add_done_callback(lambda result: self._finished(spec, result, future))
        return GrammarJob(spec, future)

    def compile(self, spec: StructuredOutputsParams) -> tuple[xgr.CompiledGrammar, float | None]:
        """Compile in this thread, without a timeout: (grammar, seconds spent compiling, None on
        a cache hit). Raises InputError."""
        key = spec.cache_key
        with self._lock:
            grammar = self._cached(key)
            if grammar is not None:
                return grammar, None
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(
                    self._tokenizer_info(), max_threads=1, cache_enabled=False
                )
            compiler = self._compiler
        start = time.perf_counter()
        try:
            grammar = compile_constraint(compiler, key)
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError, TypeError)
            raise _input_error(spec, CompileError(clean_error(exc)), self.timeout_s) from None
        seconds = time.perf_counter() - start
        with self._lock:
            self._store(key, grammar)
        return grammar, seconds

    def close(self) -> None:
        """Stop using the worker pool (the last user's release kills its workers); constraints
        still compiling fail. Later submissions are refused."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, None
        if workers is not None:
            release_pool(workers)

    # --- internals (under self._lock unless said otherwise) ----------------------------------

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        if self._info is None:
            self._info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
        return self._info

    def _cached(self, key: tuple) -> xgr.CompiledGrammar | None:
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
        return grammar

    def _store(self, key: tuple, grammar: xgr.CompiledGrammar) -> None:
        self._cache[key] = grammar
        self._cache.move_to_end(key)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _finished(self, spec: StructuredOutputsParams, done: Future, future: Future) -> None:
        """A worker's result (on the pool's manager thread, no lock held): cache it, then
        complete the job every request of this constraint waits on."""
        key = spec.cache_key
        error = done.exception()
        with self._lock:
            self._inflight.pop(key, None)
            if error is None:
                grammar, seconds = done.result()
                self._store(key, grammar)
        if error is not None:
            future.set_exception(_input_error(spec, error, self.timeout_s))
            return
        if self.on_compiled is not None:
            self.on_compiled(seconds)
        future.set_result(grammar)


def _input_error(
    spec: StructuredOutputsParams, error: BaseException, timeout_s: float
) -> InputError:
    """The client's error for a constraint that failed to compile."""
    field = f"structured_outputs.{spec.kind}"
    if isinstance(error, CompileTimeout):
        text = spec.text if len(spec.text) <= _EXCERPT else spec.text[:_EXCERPT] + "..."
        return InputError(
            f"{field} was not compiled within structured_outputs_compile_timeout_s "
            f"({timeout_s:g} s), so the compile was stopped: simplify the constraint"
            + (f" {text!r}" if text else "")
        )
    return InputError(f"{field} cannot be compiled: {error}")
