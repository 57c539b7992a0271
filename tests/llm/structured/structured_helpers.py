"""Structured-output test helpers: checkpoints with a byte-level tokenizer (every JSON character
is a token), constraints paired with the xgrammar grammar the reference compiles for them, and the
reference itself (transformers `generate` under xgrammar's Hugging Face logits processor)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers
import xgrammar as xgr

from backend_lib.llm.structured.compile_worker import BOUNDED_WHITESPACE
from tests.llm.shakespeare_helpers import SHAKESPEARE
from tooling.checkpoints import Sizes, build_checkpoint, build_random_llama

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
REGEX = r"[A-Z][a-z]{1,8} (is|was) [a-z]{1,10}\."
CHOICES = ["Romeo", "Juliet", "Tybalt"]
GRAMMAR = 'root ::= "ay" | "no" | ("my lord" [,.!])'

# name -> (structured_outputs as a client sends it, the same grammar compiled by xgrammar directly)
CONSTRAINTS: dict[str, tuple[dict[str, Any], Callable[[xgr.GrammarCompiler], Any]]] = {
    "json": (  # disable_any_whitespace unset: the engine's bounded whitespace
        {"json": SCHEMA},
        lambda c: c.compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=BOUNDED_WHITESPACE),
    ),
    "json_any_whitespace": (
        {"json": SCHEMA, "disable_any_whitespace": False},
        lambda c: c.compile_json_schema(json.dumps(SCHEMA)),
    ),
    "json_compact": (
        {"json": json.dumps(SCHEMA), "disable_any_whitespace": True},
        lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
    ),
    "regex": ({"regex": REGEX}, lambda c: c.compile_regex(REGEX)),
    "choice": (
        {"choice": CHOICES},
        lambda c: c.compile_grammar('root ::= "Romeo" | "Juliet" | "Tybalt"'),
    ),
    "grammar": ({"grammar": GRAMMAR}, lambda c: c.compile_grammar(GRAMMAR)),
    "json_object": (
        {"json_object": True},
        lambda c: c.compile_json_schema(
            '{"type": "object"}', max_whitespace_cnt=BOUNDED_WHITESPACE
        ),
    ),
    "json_object_any_whitespace": (
        {"json_object": True, "disable_any_whitespace": False},
        lambda c: c.compile_json_schema('{"type": "object"}'),
    ),
}

_BUILT: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}


def _with_shakespeare_tokenizer(out: Path) -> None:
    for name in _TOKENIZER_FILES:
        shutil.copy(SHAKESPEARE / name, out / name)


def byte_level_checkpoint(name: str) -> tuple[Path, transformers.PreTrainedModel]:
    """(dir, float32 HF model) of "shakespeare" (the committed default), "random-llama"
    (build_random_llama) or "qwen2" (a tiny random Qwen2); the random ones get the default
    model's tokenizer and its 4096-token vocabulary. Built once per process."""
    if name not in _BUILT:
        if name == "shakespeare":
            path = SHAKESPEARE
        else:
            path = Path(tempfile.mkdtemp(prefix=f"structured-{name}-"))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            if name == "random-llama":
                build_random_llama(Sizes(64, 128, 2, 4, 2, 4096), path, max_positions=256)
            else:
                build_checkpoint("Qwen2ForCausalLM", path, vocab_size=4096)
            _with_shakespeare_tokenizer(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype="float32", local_files_only=True
        ).eval()
        _BUILT[name] = (path, model)
    return _BUILT[name]


def reference_compiler(model_dir: Path, vocab_size: int) -> xgr.GrammarCompiler:
    """An xgrammar compiler of our own for the checkpoint's tokenizer (not the engine's)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
