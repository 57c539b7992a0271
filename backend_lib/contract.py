"""What the backend (model.py files, backend_lib) and the OpenAI frontend share: the one source of
every fact both sides use. Standard library only, so the frontend imports it without torch.

- Model kinds (`ModelKind`) and `model_kind`, the one function telling them apart from the tensors a
  Triton model config declares (and `is_sparse_embedding`, telling a sparse embedding model from a
  dense one).
- Tensor names of each kind's requests and responses (the llm's are those of Triton's vLLM
  backend) and the llm's `return_*` flags (`RETURN_FLAGS`).
- The spelling of boolean parameters (`parse_bool`), as `config.pbtxt` parameters are read.
- Error codes (`ErrorCode`) and their codec: a response error carries its code in its message
  (`encode_error` / `decode_error`), because a gRPC stream delivers an error as its message alone
  (tritonclient's stream callback gets an `InferenceServerException` with no status). Each code's
  Triton error code is `TRITON_ERROR_CODES` (the model sets it too, for non-streaming clients).
- The facts a served llm version publishes about itself (`ModelFacts`): a request with
  `describe` set is answered with one final response whose `model_facts` output holds them as
  JSON; nothing is generated. The frontend asks each version it serves once and caches the answer.
  Among them the names of its output parsers (`TOOL_CALL_PARSERS`, `REASONING_PARSERS`: vLLM's
  names, the config checks them at load and the frontend implements each).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

# --- model kinds -----------------------------------------------------------------------------

ModelKind = Literal["llm", "embedding", "rerank"]
MODEL_KINDS: tuple[ModelKind, ...] = get_args(ModelKind)

# --- tensor names ----------------------------------------------------------------------------

TEXT_INPUT = "text_input"
"""The llm's prompt and the embedding model's texts ([N, 1] strings)."""
INPUT_IDS = "input_ids"
"""The embedding model's items as token ids instead of texts: INT64 [N, L], N items of L tokens
each, taken as they are (special tokens are the caller's). Items of other lengths go in other
requests; the input is ragged-batched, so Triton still gives them to one `execute`."""
IMAGE = "image"
"""The embedding model's items as encoded images instead of texts: STRING (bytes) [N, 1], one PNG,
JPEG or WebP file per row (the name Triton's vLLM backend gives its image input). Only an
image-text checkpoint (CLIP, SigLIP) embeds them; a request sends one of `text_input`,
`input_ids` and `image`."""

# llm (decoupled), as Triton's vLLM backend.
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_num_cached_tokens",
)
"""Each flag adds its output (the name without `return_`) to every response of the request."""
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
LOGPROBS = "logprobs"
NUM_INPUT_TOKENS = "num_input_tokens"
"""The llm's prompt tokens; the encoders' tokens of each row after truncation."""
NUM_OUTPUT_TOKENS = "num_output_tokens"
NUM_CACHED_TOKENS = "num_cached_tokens"
"""[1] UINT32: the prompt tokens whose KV the engine read from its prefix cache instead of
computing them (0 before the request is first scheduled, and for one asking for prompt logprobs)."""
PROMPT_LOGPROBS = "prompt_logprobs"
"""[1] JSON, in the first response after the prefill of a request whose sampling_parameters set
`prompt_logprobs`: per prompt token {token_id: {logprob, rank, decoded_token}}, the prompt token
first, then the top ones; the first prompt token's logprob and rank are null (nothing precedes it).
`logprobs` entries have the same shape, the sampled token first."""
STOP_REASON = "stop_reason"
"""[-1] JSON per choice, with `finish_reason` in a response where a choice finished: vLLM's
`stop_reason`, the stop string or stop token id that finished it (null for EOS, length, or a
choice still running)."""
LLM_OUTPUTS = (
    TEXT_OUTPUT,
    FINISH_REASON,
    CUMULATIVE_LOGPROB,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    NUM_CACHED_TOKENS,
    PROMPT_LOGPROBS,
    STOP_REASON,
)

PROMPT_TOKEN_IDS = "prompt_token_ids"
"""Optional INT64 [-1] input of the llm: the prompt as token ids (vLLM's TokensPrompt), sent with
an empty `text_input`."""

DESCRIBE = "describe"
"""Optional BOOL input of the llm: true asks for its `ModelFacts` (the other inputs are ignored)."""
MODEL_FACTS = "model_facts"
"""The output answering `describe`: `ModelFacts` as JSON."""

# embedding and rerank (batched: [N, 1] rows).
NORMALIZE = "normalize"
TRUNCATE = "truncate"
PROMPT_NAME = "prompt_name"
"""Optional STRING [1] input of the embedding model, one value per request: the checkpoint's
prompt (config_sentence_transformers.json `prompts`) prepended to each text."""
DIMENSIONS = "dimensions"
"""Optional INT32 [1] input of the embedding model, one value per request: the vector size, one of
the checkpoint's `matryoshka_dimensions` or its full size (cut, then renormalised)."""
PRIORITY = "priority"
"""Optional INT32 [1] input of the embedding and rerank models, one value per request: its place in
the micro-batch scheduler's queue (lower first, default 0; backend_lib/encoder/scheduler.py)."""
EMBEDDING = "embedding"
INDICES = "indices"
"""A sparse embedding model's output instead of `embedding`: INT64 [N, K], each row's nonzero
vocabulary ids in ascending order, padded with SPARSE_PAD_INDEX to the longest row of its request
(K >= 1)."""
VALUES = "values"
"""FP32 [N, K] beside `indices`: the weight of each id, 0 at the padding."""
SPARSE_PAD_INDEX = -1
QUERY = "query"
DOCUMENT = "document"
SCORE = "score"
ENCODER_OUTPUTS: dict[str, tuple[str, ...]] = {
    "embedding": (EMBEDDING, NUM_INPUT_TOKENS),
    "rerank": (SCORE, NUM_INPUT_TOKENS),
}
SPARSE_EMBEDDING_OUTPUTS = (INDICES, VALUES, NUM_INPUT_TOKENS)
"""The outputs of an embedding model serving sparse vectors (SPLADE), instead of ENCODER_OUTPUTS'."""


def model_kind(config: Mapping[str, Any]) -> ModelKind | None:
    """A model's kind from its Triton config (the JSON of `get_model_config`, or a parsed
    config.pbtxt): a decoupled model with `text_output` is an llm, one with `embedding` (or sparse
    `indices` and `values`) an embedding model, one with `score` from `query` and `document` a
    rerank model; None for anything else."""
    outputs = {output.get("name") for output in config.get("output", [])}
    inputs = {item.get("name") for item in config.get("input", [])}
    decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))
    if decoupled and TEXT_OUTPUT in outputs:
        return "llm"
    if decoupled:
        return None
    if EMBEDDING in outputs or {INDICES, VALUES} <= outputs:
        return "embedding"
    if SCORE in outputs and {QUERY, DOCUMENT} <= inputs:
        return "rerank"
    return None


def is_sparse_embedding(config: Mapping[str, Any]) -> bool:
    """Whether a Triton config (as `model_kind` reads it) is an embedding model serving sparse
    vectors: `indices` and `values` instead of `embedding`."""
    outputs = {output.get("name") for output in config.get("output", [])}
    return model_kind(config) == "embedding" and EMBEDDING not in outputs


# --- boolean parameters ----------------------------------------------------------------------

TRUE_SPELLINGS = frozenset({"true", "1", "yes", "on"})
FALSE_SPELLINGS = frozenset({"false", "0", "no", "off"})


def parse_bool(raw: object) -> bool:
    """A boolean parameter written as true/false, 1/0, yes/no or on/off (any case, spaces
    around ignored); ValueError for anything else."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in TRUE_SPELLINGS:
        return True
    if text in FALSE_SPELLINGS:
        return False
    raise ValueError(f"expected a boolean (true/false), got {raw!r}")


# --- errors ----------------------------------------------------------------------------------


class ErrorCode(str, enum.Enum):
    """Why a request failed, as the client is told."""

    INVALID_INPUT = "invalid_input"
    """The request is malformed or out of limits."""
    QUEUE_FULL = "queue_full"
    """Refused: the waiting queue is full; retry later."""
    UNAVAILABLE = "unavailable"
    """The model cannot serve now (e.g. shutting down)."""
    CANCELLED = "cancelled"
    """The request was cancelled before it finished."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The request passed its deadline (Triton's request timeout, `deadline_ms`, the frontend's
    `x-request-timeout`) before it finished."""
    QUEUE_TIMEOUT = "queue_timeout"
    """The request waited longer than the model's `max_queue_wait_ms` for a batch slot; retry
    later."""
    INTERNAL = "internal"
    """A failure of the server, not of the request."""


TRITON_ERROR_CODES: dict[ErrorCode, str] = {
    ErrorCode.INVALID_INPUT: "INVALID_ARG",
    ErrorCode.QUEUE_FULL: "UNAVAILABLE",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.CANCELLED: "CANCELLED",
    ErrorCode.DEADLINE_EXCEEDED: "UNAVAILABLE",
    ErrorCode.QUEUE_TIMEOUT: "UNAVAILABLE",
    ErrorCode.INTERNAL: "INTERNAL",
}
"""The `pb_utils.TritonError` code (attribute name) a response error of each code is sent with."""

_BY_VALUE = {code.value: code for code in ErrorCode}


def encode_error(code: ErrorCode, message: str) -> str:
    """The message of a response error: `[<code>] <message>`."""
    return f"[{code.value}] {message}"


def decode_error(text: str) -> tuple[ErrorCode | None, str]:
    """(code, message) of an error text made by `encode_error`; (None, text) for any other text
    (an error of Triton itself, or of a model that does not use this contract)."""
    if text.startswith("["):
        value, closed, message = text[1:].partition("] ")
        if closed and value in _BY_VALUE:
            return _BY_VALUE[value], message
    return None, text


# --- published facts -------------------------------------------------------------------------


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_xml")
"""The llm's `tool_call_parser` values (vLLM's `--tool-call-parser` names): how the frontend finds
tool calls in a model's text for `tool_choice` "auto"."""
REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""The llm's `reasoning_parser` values (vLLM's `--reasoning-parser` names): how the frontend splits
a model's reasoning (`<think>...</think>`) from its answer."""


@dataclass(frozen=True)
class ModelFacts:
    """What a served llm version decided about itself at load, for the frontend to use as is.

    `max_model_len`: the engine's limit of prompt plus output tokens (None: not published).
    `lora_adapters`: the adapter names its LoRA registry serves (empty when LoRA is off).
    `tool_call_parser`: one of `TOOL_CALL_PARSERS`, the format of its tool calls (None: none).
    `reasoning_parser`: one of `REASONING_PARSERS`, the format of its reasoning (None: none).
    `max_images`: images one prompt may hold (0: the model takes none).
    `max_image_bytes`: encoded size one image may have (0: the model takes none)."""

    max_model_len: int | None = None
    lora_adapters: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_images: int = 0
    max_image_bytes: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "max_model_len": self.max_model_len,
                "lora_adapters": list(self.lora_adapters),
                "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser,
                "max_images": self.max_images,
                "max_image_bytes": self.max_image_bytes,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelFacts:
        """ValueError when `text` is not facts JSON."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"model facts must be a JSON object, got {type(data).__name__}")
        length = data.get("max_model_len")
        adapters = data.get("lora_adapters") or []
        if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
            raise ValueError(f"max_model_len must be an integer, got {length!r}")
        if not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters):
            raise ValueError(f"lora_adapters must be a list of names, got {adapters!r}")
        tool_call_parser = _known(data, "tool_call_parser", TOOL_CALL_PARSERS)
        reasoning_parser = _known(data, "reasoning_parser", REASONING_PARSERS)
        images = [_count(data, key) for key in ("max_images", "max_image_bytes")]
        return cls(length, tuple(adapters), tool_call_parser, reasoning_parser, *images)


def _count(data: Mapping[str, Any], key: str) -> int:
    """`data[key]`: an integer >= 0 (0 when absent)."""
    value = data.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def _known(data: Mapping[str, Any], key: str, names: tuple[str, ...]) -> str | None:
    """`data[key]`: None (absent or null) or one of `names`."""
    value = data.get(key)
    if value is not None and value not in names:
        raise ValueError(f"{key} must be null or one of {', '.join(names)}, got {value!r}")
    return value
