"""Constraint -> xgrammar CompiledGrammar, one compiler per tokenizer, grammars cached by text.

The compiler (and the tokenizer's xgrammar vocabulary table) is built on the first constrained
request, so an engine that never sees one pays nothing. Compile errors of every kind (a schema
xgrammar rejects, a bad regex, an EBNF syntax error) become InputError naming the field.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from backend_lib.errors import InputError
from backend_lib.llm.structured.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/file.cc:42: "


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer; thread-safe (submitting threads)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's); `stop_token_ids`:
        the tokens that end a sequence (EOS), allowed only where the grammar can end."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> tuple[xgr.CompiledGrammar, float | None]:
        """(grammar, seconds spent compiling, None on a cache hit). Raises InputError."""
        with self._lock:
            grammar = self._cache.get(spec.cache_key)
            if grammar is not None:
                self._cache.move_to_end(spec.cache_key)
                return grammar, None
            start = time.perf_counter()
            grammar = self._compile(spec)
            seconds = time.perf_counter() - start
            self._cache[spec.cache_key] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return grammar, seconds

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler = self._compiler
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(
                    spec.text, any_whitespace=not spec.disable_any_whitespace
                )
            if spec.kind == "json_object":
                if spec.disable_any_whitespace:
                    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            return compiler.compile_grammar(spec.text)  # grammar, and choice as a grammar
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError, TypeError)
            raise InputError(
                f"structured_outputs.{spec.kind} cannot be compiled: {_clean(exc)}"
            ) from None


def _clean(exc: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
