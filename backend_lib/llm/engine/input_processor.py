"""Input processing: an `EngineRequest` -> a validated, tokenized `PreparedRequest`.

Runs on the caller's thread (Triton's, in the served model) and touches no engine state, so a
slow tokenization or adapter load of one request never holds the step. A structured_outputs
constraint is handed to the GrammarCompiler, which compiles it in a worker process: the caller
waits at most `grammar_wait` seconds for it (a cache hit, a quick compile or a quick failure:
then an InputError here), else the request goes on with its `GrammarJob` pending and the engine
holds it until the grammar is ready. Every problem is an InputError for that request only.

Length policy: `max_tokens=None` generates up to max_model_len; a `max_tokens` beyond what fits
(max_model_len - prompt) is not an error, the output just stops at max_model_len with "length"
(vLLM's engine behaviour). Only a prompt leaving no room for one output token is refused.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from backend_lib.errors import InputError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import check_prompt_fits
from backend_lib.llm.engine.mm_processor import MultiModalProcessor
from backend_lib.llm.lora.registry import LORA_DISABLED_ERROR, LoRARegistry
from backend_lib.llm.lora.request import LoRARequest
from backend_lib.llm.structured.compiler import GrammarCompiler, GrammarJob


@dataclass
class PreparedRequest:
    """A validated, tokenized request, ready for `LLMEngine.add_prepared`."""

    request: EngineRequest
    """The request as submitted, its `arrival_time` filled in."""
    prompt_token_ids: list[int]
    """The prompt's token ids (given, or from the tokenizer)."""
    grammar: xgr.CompiledGrammar | None = None
    """params.structured_outputs compiled for this engine's tokenizer (None: unconstrained, or
    still compiling)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs under (None: the base model)."""
    grammar_job: GrammarJob | None = None
    """The constraint still compiling (None: `grammar` is final); the engine holds the request
    outside the scheduler until it is done."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> str | None:
        return self.request.prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def arrival_time(self) -> float:
        """Seconds on `time.monotonic()`."""
        return self.request.arrival_time


MAX_TENANT_CHARS = 256


def _check_tenant(tenant: object) -> None:
    """None, or a non-empty string of at most MAX_TENANT_CHARS characters."""
    if tenant is None:
        return
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
        raise InputError(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters, "
            f"got {tenant!r}"[:400]
        )


PRIORITY_RANGE = (-(2**31), 2**31 - 1)
"""A request's priority, as a 32-bit integer (the scheduler's sort key adds it to a float)."""


class InputProcessor:
    """Validation, tokenization, adapter and grammar resolution for one engine (thread-safe)."""

    def __init__(
        self,
        config: LLMConfig,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        grammar_compiler: GrammarCompiler,
        lora_registry: LoRARegistry | None,
        images: MultiModalProcessor | None = None,
    ) -> None:
        """`images`: a vision-language model's image processing (None: the model takes none)."""
        self.config = config
        self.images = images
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammar_compiler = grammar_compiler
        self.lora_registry = lora_registry
        # transformers may reconfigure the Rust tokenizer inside a call (truncation, padding);
        # concurrent callers must not interleave there.
        self._tokenizer_lock = threading.Lock()

    def prepare(self, request: EngineRequest, grammar_wait: float | None = None) -> PreparedRequest:
        """Validate and tokenize (unless `prompt_token_ids` is given); submit the constraint.

        Raises InputError for bad parameters, an empty prompt, token ids outside the vocabulary,
        a prompt that leaves no room for output within max_model_len, a `lora_name` that cannot
        be served (LoRA disabled, unknown name, bad adapter directory; loads the adapter
        otherwise), or a structured_outputs constraint that failed to compile within
        `grammar_wait` seconds (None: waits for the compile; past it the request comes back
        with its `grammar_job` pending).
        """
        if not isinstance(request, EngineRequest):
            raise InputError(f"request must be an EngineRequest, got {type(request).__name__}")
        if request.arrival_time is None:
            request = dataclasses.replace(request, arrival_time=time.monotonic())
        request_id, params = request.request_id, request.params
        if not isinstance(request_id, str) or not request_id:
            raise InputError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(max_logprobs=self.config.max_logprobs, max_n=self.config.max_n)
        self._check_priority(request.priority)
        _check_tenant(request.tenant)
        self._check_token_ids("stop_token_ids", params.stop_token_ids or [])
        ids, request = self._prompt_with_images(request)
        check_prompt_fits(len(ids), self.max_model_len)
        lora_request = self.resolve_lora(request.lora_name)
        grammar, job = None, None
        if params.structured_outputs is not None:
            job = self.grammar_compiler.submit(params.structured_outputs)
            if job.wait(grammar_wait):
                grammar, job = job.result(), None
        return PreparedRequest(request, ids, grammar, lora_request, job)

    def _prompt_with_images(self, request: EngineRequest) -> tuple[list[int], EngineRequest]:
        """The prompt's ids, its images' placeholders replaced by their tokens, and the request
        with their features (`mm_features`) in place of the decoded images."""
        if not request.images:
            ids = self._prompt_ids(request.prompt, request.prompt_token_ids)
            if self.images is not None:
                self.images.check_text_only(ids)
            return ids, request
        if self.images is None:
            raise InputError("this model takes no images (it is not a vision-language model)")
        if request.prompt_token_ids is not None:
            ids = self._prompt_ids(None, request.prompt_token_ids)
            ids, features = self.images.process_ids(ids, request.images)
        else:
            prompt = request.prompt
            if not isinstance(prompt, str) or not prompt:
                raise InputError(f"prompt must be a non-empty string, got {prompt!r}"[:200])
            ids, features = self.images.process_text(prompt, request.images, self._tokenize)
        # The decoded pictures are dropped here: the request keeps only the processed tensors.
        return ids, dataclasses.replace(request, mm_features=tuple(features), images=())

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

    def _check_priority(self, priority: object) -> None:
        """An integer in PRIORITY_RANGE; other than 0 only under `scheduling_policy: priority`
        (vLLM's rule)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InputError(f"priority must be an integer, got {priority!r}")
        low, high = PRIORITY_RANGE
        if not low <= priority <= high:
            raise InputError(f"priority must be in [{low}, {high}], got {priority}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InputError(
                f"got priority {priority}, but priority scheduling is not enabled "
                "(scheduling_policy is fcfs)"
            )

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            self._check_token_ids("prompt_token_ids", ids)
        elif isinstance(prompt, str):
            ids = self._tokenize(prompt) if prompt else []
        else:
            raise InputError(f"prompt must be a string, got {type(prompt).__name__}")
        if not ids:
            raise InputError("the prompt is empty")
        return ids

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
