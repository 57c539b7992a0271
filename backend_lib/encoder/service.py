"""Request handling for the encoder models: each request is parsed and tokenized on its own, so bad
input fails only that request; the items of all good requests, whatever execute call brought them,
are then embedded (or scored) in micro-batches the scheduler chooses by priority, deadline and
arrival (scheduler.py), and each request is answered when its items are done, with the tokens each
item was computed on (`num_input_tokens`, after truncation: what an API reports as usage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from backend_lib.config import ConfigError, from_parameters
from backend_lib.contract import (
    DIMENSIONS,
    EMBEDDING,
    IMAGE,
    INDICES,
    INPUT_IDS,
    NORMALIZE,
    NUM_INPUT_TOKENS,
    PRIORITY,
    PROMPT_NAME,
    SCORE,
    TEXT_INPUT,
    TRUNCATE,
    VALUES,
    ErrorCode,
    is_sparse_embedding,
)
from backend_lib.encoder.batching import MicroBatch
from backend_lib.encoder.config import EmbeddingConfig, RerankConfig
from backend_lib.encoder.embedder import Embedder, EmbedderInputs, reduce
from backend_lib.encoder.image_text import FAMILIES, ImageTextEmbedder, serves_image_text
from backend_lib.encoder.reranker import load_reranker
from backend_lib.encoder.scheduler import EncoderJob, EncoderScheduler
from backend_lib.encoder.sparse import SparseEmbedder, pad_rows, serves_sparse
from backend_lib.errors import InputError, error_code
from backend_lib.metrics import MetricsSink
from backend_lib.model_context import ModelContext
from backend_lib.multimodal.image_sources import image_input_bytes
from backend_lib.triton_io import (
    Inputs,
    read_blobs,
    read_bools,
    read_shared,
    read_strings,
    read_token_rows,
)

Result = dict[str, np.ndarray] | Exception
"""A request's output tensors by name, or the error it fails with."""

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


FAILURE_REASONS = ("invalid_input", "deadline_exceeded", "unavailable", "internal")
"""Every `reason` of `encoder_failures_total`, each exported from load."""


def failure_reason(error: Exception) -> str:
    """The `reason` label of a failed request."""
    code = error_code(error)
    reason = "internal" if code is ErrorCode.INTERNAL else code.value
    return reason if reason in FAILURE_REASONS else "internal"


class EncoderMetrics:
    """Encoder metrics: requests and items, micro-batch shape, queue and compute time, failures.
    Every series exists from load with value 0."""

    def __init__(self, sink: MetricsSink):
        self.requests = sink.counter("encoder_requests_total", "Requests received")
        self.items = sink.counter("encoder_items_total", "Items (texts or pairs) computed")
        self.failures = sink.counter("encoder_failures_total", "Failed requests, by reason")
        self.batch_size = sink.histogram(
            "encoder_batch_size", "Items per micro-batch", SIZE_BUCKETS
        )
        self.batch_tokens = sink.histogram(
            "encoder_batch_tokens", "Padded tokens per micro-batch", TOKEN_BUCKETS
        )
        self.batch_requests = sink.histogram(
            "encoder_batch_requests",
            "Distinct requests whose items share a micro-batch",
            SIZE_BUCKETS,
        )
        self.queue_seconds = sink.histogram(
            "encoder_queue_seconds",
            "Time from a request's arrival to the start of a micro-batch with its items",
            SECONDS_BUCKETS,
        )
        self.compute_seconds = sink.histogram(
            "encoder_compute_seconds", "Forward time per micro-batch", SECONDS_BUCKETS
        )
        for series in (
            self.requests,
            self.items,
            self.batch_size,
            self.batch_tokens,
            self.batch_requests,
            self.queue_seconds,
            self.compute_seconds,
        ):
            series.touch()
        for reason in FAILURE_REASONS:
            self.failures.touch(reason=reason)

    def record_batch(
        self, members: Sequence[tuple[object, int]], batch: MicroBatch, started: float
    ) -> None:
        """One micro-batch: `members` are its (job, item index), `started` when it started
        (time.monotonic()); each request in it observes its wait from arrival to then."""
        jobs = dict.fromkeys(job for job, _ in members)
        self.batch_size.observe(len(members))
        self.batch_tokens.observe(batch.padded_tokens)
        self.batch_requests.observe(len(jobs))
        self.compute_seconds.observe(batch.seconds)
        for job in jobs:
            self.queue_seconds.observe(max(0.0, started - job.arrival))

    def record_failure(self, error: Exception) -> None:
        self.failures.inc(reason=failure_reason(error))


class Lane(NamedTuple):
    """The micro-batch scheduler's priority lane: its budget (0: none) and what its forwards run
    in."""

    tokens: int
    context: Callable[[], contextlib.AbstractContextManager]


NO_LANE = Lane(0, contextlib.nullcontext)


def priority_lane(tokens: int, encoder) -> Lane:
    """The lane of a model on `encoder` with `priority_lane_tokens` = tokens: none unless its
    forwards may run concurrently; on CUDA its forwards go to a high-priority stream, which the
    GPU serves ahead of the main lane's queued kernels."""
    if tokens == 0 or not getattr(encoder, "concurrent_forwards", False):
        return NO_LANE
    if encoder.device.type != "cuda":
        return Lane(tokens, contextlib.nullcontext)
    stream = torch.cuda.Stream(encoder.device, priority=-1)
    return Lane(tokens, lambda: torch.cuda.stream(stream))


class _EncoderService:
    """Shared flow: parse and tokenize each request on its own (a bad one fails alone), then queue
    its items on the micro-batch scheduler (scheduler.py), which answers it when they are
    computed, with the tokens each item was computed on."""

    output = ""
    """The name of the computed output (beside NUM_INPUT_TOKENS)."""

    def __init__(self, metrics: EncoderMetrics | None, lane: Lane = NO_LANE):
        self.metrics = metrics
        self.lane = lane
        self._scheduler: EncoderScheduler | None = None

    @property
    def scheduler(self) -> EncoderScheduler:
        """The micro-batch scheduler (made on first use: it needs the loaded model's budget)."""
        if self._scheduler is None:
            tokens, size = self._budget()
            self._scheduler = EncoderScheduler(
                self._compute, tokens, size, self._record_batch, *self.lane
            )
        return self._scheduler

    def start(self) -> None:
        """Compute on the scheduler's own thread from now on (model.py; `submit` then returns at
        once)."""
        self.scheduler.start()

    def shutdown(self) -> None:
        """Answer the waiting requests UNAVAILABLE and stop the scheduler's thread."""
        if self._scheduler is not None:
            self._scheduler.stop(timeout=60)

    def submit(
        self, inputs: Inputs, on_done: Callable[[Result], None], timeout_us: int = 0
    ) -> None:
        """Parse, tokenize and queue one request. `on_done(result)` is called once: at once for a
        bad request, else when its items are computed (on the scheduler's thread once started),
        or it failed, or it passed its deadline. `timeout_us`: Triton's request timeout in
        microseconds (`request.timeout()`, 0: none)."""
        arrival = time.monotonic()
        if self.metrics:
            self.metrics.requests.inc()
        try:
            items = self._tokenize_request(inputs)
            priority = read_priority(inputs, len(items))
        except Exception as exc:  # a bad request fails alone
            self._answer(on_done, exc if isinstance(exc, InputError) else InputError(str(exc)))
            return
        deadline = arrival + timeout_us / 1e6 if timeout_us > 0 else None
        lengths = [self._num_tokens(item) for item in items]

        def done(values, error: Exception | None) -> None:
            self._answer(on_done, error if error is not None else self._outputs(values, items))

        job = EncoderJob(items, lengths, done, priority, deadline, arrival)
        try:
            self.scheduler.submit(job)
        except Exception as exc:  # unloading
            self._answer(on_done, exc)

    def execute(self, requests: Sequence[Inputs]) -> list[Result]:
        """Compute requests together; their results in order. Without the scheduler's thread the
        micro-batches run in this thread."""
        results: list[Result | None] = [None] * len(requests)
        answered = threading.Semaphore(0)

        def keep(index: int, result: Result) -> None:
            results[index] = result
            answered.release()

        for index, inputs in enumerate(requests):
            self.submit(inputs, functools.partial(keep, index))
        if not self.scheduler.threaded:
            self.scheduler.run_until_idle()
        for _ in requests:
            answered.acquire()
        return results  # type: ignore[return-value]

    def _outputs(self, values, items: list) -> Result:
        """One request's output tensors from its items' computed values."""
        try:
            outputs = self._request_outputs(values, items)
        except Exception as exc:
            return RuntimeError(f"encoder output failed: {type(exc).__name__}: {exc}")
        tokens = np.array([[self._num_tokens(item)] for item in items], dtype=np.uint32)
        if self.metrics:
            self.metrics.items.inc(len(items))
        return {**outputs, NUM_INPUT_TOKENS: tokens}

    def _answer(self, on_done: Callable[[Result], None], result: Result) -> None:
        if self.metrics and isinstance(result, Exception):
            self.metrics.record_failure(result)
        on_done(result)

    def _record_batch(
        self, members: list[tuple[EncoderJob, int]], batch: MicroBatch, started: float
    ) -> None:
        if self.metrics:
            self.metrics.record_batch(members, batch, started)

    def _request_outputs(self, values: np.ndarray, items: list) -> dict[str, np.ndarray]:
        """One request's output tensors (beside NUM_INPUT_TOKENS) from its rows of the computed
        values (its `items`)."""
        return {self.output: values}

    def _budget(self) -> tuple[int, int]:
        """(max_batch_tokens, max_batch_size) of one micro-batch."""
        raise NotImplementedError

    def _tokenize_request(self, inputs: Inputs) -> list:
        raise NotImplementedError

    def _num_tokens(self, item) -> int:
        """The tokens the model computes for one tokenized item."""
        raise NotImplementedError

    def _compute(self, items: list) -> tuple[np.ndarray, list[MicroBatch]]:
        raise NotImplementedError


def read_priority(inputs: Inputs, count: int) -> int:
    """The request's optional `priority` input (one INT32 value shared by its `count` rows, lower
    first; 0 when absent)."""
    value = read_shared(inputs, PRIORITY, count)
    if value is None:
        return 0
    if not np.issubdtype(value.dtype, np.integer):
        raise InputError(f"input '{PRIORITY}' must be TYPE_INT32, got {value.dtype}")
    return int(value[0])


def _by_flag(flags: Sequence[bool | None], run: Callable[[list[int], bool | None], list]) -> list:
    """Call `run(indices, flag)` once per distinct flag value, returning results in row order."""
    out: list = [None] * len(flags)
    for flag in dict.fromkeys(flags):
        indices = [i for i, f in enumerate(flags) if f == flag]
        for i, value in zip(indices, run(indices, flag), strict=True):
            out[i] = value
    return out


def _check_declared_outputs(model_config: dict, sparse: bool, mode: str) -> None:
    """Refuse a config.pbtxt declaring the other kind of vectors' outputs than the model computes
    (every request would fail); a config without outputs (tests) passes."""
    if not model_config.get("output") or is_sparse_embedding(model_config) == sparse:
        return
    computed = f"'{INDICES}' and '{VALUES}'" if sparse else f"'{EMBEDDING}'"
    raise ConfigError(
        "mode",
        mode,
        f"the checkpoint is served as {'sparse' if sparse else 'dense'} vectors (outputs "
        f"{computed}) but config.pbtxt declares the other kind's outputs; render config.pbtxt "
        "with this mode (scripts/add_model.py --param mode=...)",
    )


def _read_token_items(
    inputs: Inputs, embedder: EmbedderInputs
) -> tuple[list[list[int]], str | None]:
    """A request's items as token ids, and the prompt prepended to its texts: `text_input` texts
    with the prompt `prompt_name` names (default: the checkpoint's), tokenized as their `truncate`
    says, or `input_ids` as sent (no prompt: None). `image` is refused: these models embed
    texts only (`ImageTextEmbeddingService` reads images)."""
    if IMAGE in inputs:
        raise InputError(
            f"input '{IMAGE}': this is a text-only embedding model; images need an image-text "
            f"checkpoint ({', '.join(FAMILIES)})"
        )
    if (TEXT_INPUT in inputs) == (INPUT_IDS in inputs):
        raise InputError(
            f"send exactly one of '{TEXT_INPUT}' (texts) and '{INPUT_IDS}' (token ids)"
        )
    if INPUT_IDS in inputs:
        if PROMPT_NAME in inputs:
            raise InputError(
                f"'{PROMPT_NAME}' applies to '{TEXT_INPUT}' only: token ids are used as sent"
            )
        return embedder.check_token_ids(read_token_rows(inputs, INPUT_IDS)), None
    texts = read_strings(inputs, TEXT_INPUT)
    name = read_shared(inputs, PROMPT_NAME, len(texts))
    prompt_name = None if name is None else read_strings({PROMPT_NAME: name}, PROMPT_NAME)[0]
    prompt = embedder.resolve_prompt(prompt_name)
    # Size limits are the tokenizer's (max_text_bytes): cut when truncating, refused otherwise.
    truncate = read_bools(inputs, TRUNCATE, len(texts), None)
    tokens = _by_flag(
        truncate,
        lambda idx, flag: embedder.tokenize([texts[i] for i in idx], truncate=flag, prompt=prompt),
    )
    return tokens, prompt


class _EmbeddingItem(NamedTuple):
    tokens: list[int]
    normalize: bool | None  # None: the model's default
    skip: int  # leading tokens left out of pooling (the prompt's, when include_prompt is false)
    dimensions: int  # the request's vector size


class EmbeddingService(_EncoderService):
    """`text_input` [N,1] strings (optional `truncate` BOOL) or `input_ids` INT64 [N, L], optional
    `normalize` BOOL, and per request optional `prompt_name` STRING (texts only; default: the
    checkpoint's `default_prompt_name`) and `dimensions` INT32 (one of the model's Matryoshka sizes
    or its full size) -> `embedding` [N, dimensions] float32 and `num_input_tokens` [N, 1] (each
    item's tokens, special tokens and prompt included)."""

    output = EMBEDDING

    def __init__(self, embedder, metrics: EncoderMetrics | None = None, lane: Lane = NO_LANE):
        super().__init__(metrics, lane)
        self.embedder = embedder

    @classmethod
    def from_context(
        cls, context: ModelContext, sink: MetricsSink | None
    ) -> EmbeddingService | SparseEmbeddingService:
        """Load from the model's config.pbtxt parameters (raises ConfigError naming a bad key); a
        model serving sparse vectors (`EmbeddingConfig.mode`) is a `SparseEmbeddingService`, one
        on a CLIP or SigLIP checkpoint an `ImageTextEmbeddingService`."""
        config = from_parameters(EmbeddingConfig, context.parameters)
        metrics = EncoderMetrics(sink) if sink else None
        if serves_image_text(config, context.model_dir):
            _check_declared_outputs(context.model_config, False, config.mode)
            embedder = ImageTextEmbedder.from_config(config, context.device, context.model_dir)
            return ImageTextEmbeddingService(embedder, metrics)
        sparse = serves_sparse(config, context.model_dir)
        _check_declared_outputs(context.model_config, sparse, config.mode)
        if sparse:
            embedder = SparseEmbedder.from_config(config, context.device, context.model_dir)
            lane = priority_lane(config.priority_lane_tokens, embedder.encoder)
            return SparseEmbeddingService(embedder, metrics, lane)
        embedder = Embedder.from_config(config, context.device, context.model_dir)
        return cls(embedder, metrics, priority_lane(config.priority_lane_tokens, embedder.encoder))

    def _tokenize_request(self, inputs: Inputs) -> list:
        tokens, prompt = _read_token_items(inputs, self.embedder)
        skip = self.embedder.pool_skip(prompt)
        dimensions, normalize = self._vector_options(inputs, len(tokens))
        return [
            _EmbeddingItem(t, n, skip, dimensions) for t, n in zip(tokens, normalize, strict=True)
        ]

    def _vector_options(self, inputs: Inputs, count: int) -> tuple[int, list[bool | None]]:
        """A request's vector size (`dimensions`, shared by its `count` rows) and each row's
        `normalize` (None: the model's default)."""
        size = read_shared(inputs, DIMENSIONS, count)
        if size is not None and not np.issubdtype(size.dtype, np.integer):
            raise InputError(f"input '{DIMENSIONS}' must be TYPE_INT32, got {size.dtype}")
        dimensions = self.embedder.check_dimensions(None if size is None else int(size[0]))
        return dimensions, read_bools(inputs, NORMALIZE, count, None)

    def _num_tokens(self, item) -> int:
        return len(item.tokens)

    def _budget(self) -> tuple[int, int]:
        return self.embedder.max_batch_tokens, self.embedder.max_batch_size

    def _unit(self, item: _EmbeddingItem) -> bool:
        return self.embedder.normalize_default if item.normalize is None else item.normalize

    def _compute(self, items: list) -> tuple[np.ndarray, list[MicroBatch]]:
        tokens = [item.tokens for item in items]
        skip = [item.skip for item in items]
        return self._embed_by_norm(
            items, lambda normalize: self.embedder.embed(tokens, normalize=normalize, skip=skip)
        )

    def _embed_by_norm(
        self, items: list, embed: Callable[[bool | None], tuple[np.ndarray, list[MicroBatch]]]
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """`embed(normalize)` of items whose rows may normalise differently: once with the
        `normalize` they all share, or raw, then each row made unit length as its item says."""
        normalize = [item.normalize for item in items]
        if len(set(normalize)) == 1:
            return embed(normalize[0])
        raw, batches = embed(False)
        for i, item in enumerate(items):
            if self._unit(item):
                raw[i] = raw[i] / max(float(np.linalg.norm(raw[i])), 1e-12)
        return raw, batches

    def _request_outputs(self, values: np.ndarray, items: list) -> dict[str, np.ndarray]:
        unit = [self._unit(item) for item in items]
        return {EMBEDDING: reduce(values, items[0].dimensions, unit)}


class _ImageItem(NamedTuple):
    pixels: torch.Tensor  # [3, H, W] float32: the checkpoint's image processor's output
    normalize: bool | None  # None: the model's default
    dimensions: int  # the request's vector size
    num_tokens: int  # the vision tower's tokens: the scheduler's length, num_input_tokens


class ImageTextEmbeddingService(EmbeddingService):
    """A CLIP or SigLIP checkpoint's requests (`ImageTextEmbedder`): `EmbeddingService`'s texts or
    token ids, or `image` [N, 1] encoded images (PNG, JPEG or WebP files, raw or as base64 text
    as Triton's vLLM backend takes them; with `normalize` and `dimensions`, no `prompt_name` or
    `truncate`), exactly one of the three -> `embedding` [N, dim] float32 in the shared space and
    `num_input_tokens` [N, 1] (an image: its vision tower's tokens). Images are decoded and
    preprocessed as the request arrives; a micro-batch's images and texts are computed apart."""

    embedder: ImageTextEmbedder

    def _tokenize_request(self, inputs: Inputs) -> list:
        sent = [name for name in (TEXT_INPUT, INPUT_IDS, IMAGE) if name in inputs]
        if len(sent) != 1:
            raise InputError(
                f"send exactly one of '{TEXT_INPUT}' (texts), '{INPUT_IDS}' (token ids) and "
                f"'{IMAGE}' (encoded images); got {', '.join(sent) or 'none'}"
            )
        return self._read_images(inputs) if sent == [IMAGE] else super()._tokenize_request(inputs)

    def _read_images(self, inputs: Inputs) -> list[_ImageItem]:
        for name in (PROMPT_NAME, TRUNCATE):
            if name in inputs:
                raise InputError(f"'{name}' applies to texts only, not to '{IMAGE}'")
        images = read_blobs(inputs, IMAGE)
        dimensions, normalize = self._vector_options(inputs, len(images))
        max_bytes = self.embedder.limits.max_image_bytes
        items = []
        for index, (value, unit) in enumerate(zip(images, normalize, strict=True)):
            try:
                pixels = self.embedder.preprocess_image(image_input_bytes(value, max_bytes))
            except InputError as exc:
                raise InputError(f"input '{IMAGE}'[{index}]: {exc}") from None
            items.append(_ImageItem(pixels, unit, dimensions, self.embedder.image_tokens))
        return items

    def _num_tokens(self, item) -> int:
        return item.num_tokens if isinstance(item, _ImageItem) else len(item.tokens)

    def _compute(self, items: list) -> tuple[np.ndarray, list[MicroBatch]]:
        """Texts and images of one scheduler micro-batch, each kind on its own tower."""
        images = [i for i, item in enumerate(items) if isinstance(item, _ImageItem)]
        texts = [i for i, item in enumerate(items) if not isinstance(item, _ImageItem)]
        out = np.empty((len(items), self.embedder.dim), dtype=np.float32)
        reports: list[MicroBatch] = []
        for indices, compute in ((texts, super()._compute), (images, self._compute_images)):
            if indices:
                values, batches = compute([items[i] for i in indices])
                out[indices] = values
                reports += [_renumbered(batch, indices) for batch in batches]
        return out, reports

    def _compute_images(self, items: list[_ImageItem]) -> tuple[np.ndarray, list[MicroBatch]]:
        pixels = [item.pixels for item in items]
        return self._embed_by_norm(
            items, lambda normalize: self.embedder.embed_images(pixels, normalize)
        )


def _renumbered(batch: MicroBatch, indices: list[int]) -> MicroBatch:
    """A micro-batch report over a subset of items (`indices`), in the whole list's numbering."""
    return dataclasses.replace(batch, indices=[indices[i] for i in batch.indices])


class SparseEmbeddingService(_EncoderService):
    """A SPLADE model's requests, read as `EmbeddingService` reads them (`text_input` with
    `truncate` and `prompt_name`, or `input_ids`; no `normalize` or `dimensions`) -> `indices`
    INT64 and `values` FP32 [N, K] (each row's nonzero vocabulary ids, ascending, and their
    weights, padded to the request's longest row with -1 and 0: `sparse.pad_rows`) and
    `num_input_tokens` [N, 1]."""

    def __init__(
        self, embedder: SparseEmbedder, metrics: EncoderMetrics | None = None, lane: Lane = NO_LANE
    ):
        super().__init__(metrics, lane)
        self.embedder = embedder

    def _tokenize_request(self, inputs: Inputs) -> list:
        for name in (NORMALIZE, DIMENSIONS):
            if name in inputs:
                raise InputError(f"'{name}' does not apply to a sparse embedding model")
        return _read_token_items(inputs, self.embedder)[0]

    def _num_tokens(self, item) -> int:
        return len(item)

    def _budget(self) -> tuple[int, int]:
        return self.embedder.max_batch_tokens, self.embedder.max_batch_size

    def _compute(self, items: list) -> tuple[list, list[MicroBatch]]:
        return self.embedder.embed(items)  # a list of SparseVector, sliced per request

    def _request_outputs(self, values: list, items: list) -> dict[str, np.ndarray]:
        indices, weights = pad_rows(values)
        return {INDICES: indices, VALUES: weights}


class RerankService(_EncoderService):
    """`query`, `document` [N,1] strings (one pair per row) -> `score` [N, 1] and
    `num_input_tokens` [N, 1] (each pair's tokens, as the reranker computed them)."""

    output = SCORE

    def __init__(self, reranker, metrics: EncoderMetrics | None = None, lane: Lane = NO_LANE):
        super().__init__(metrics, lane)
        self.reranker = reranker

    @classmethod
    def from_context(cls, context: ModelContext, sink: MetricsSink | None) -> RerankService:
        """Load from the model's config.pbtxt parameters (raises ConfigError naming a bad key)."""
        config = from_parameters(RerankConfig, context.parameters)
        reranker = load_reranker(config, context.device, context.model_dir)
        encoder = getattr(reranker, "encoder", None) or reranker.embedder.encoder
        lane = priority_lane(config.priority_lane_tokens, encoder)
        return cls(reranker, EncoderMetrics(sink) if sink else None, lane)

    def _tokenize_request(self, inputs: Inputs) -> list:
        queries = read_strings(inputs, "query")
        documents = read_strings(inputs, "document")
        if len(queries) != len(documents):
            raise InputError(
                f"'query' has {len(queries)} rows but 'document' has {len(documents)}: "
                "send one query-document pair per row"
            )
        truncate = read_bools(inputs, "truncate", len(queries), None)
        return _by_flag(
            truncate,
            lambda idx, flag: self.reranker.tokenize(
                [queries[i] for i in idx], [documents[i] for i in idx], truncate=flag
            ),
        )

    def _num_tokens(self, item) -> int:
        return self.reranker.num_tokens(item)

    def _budget(self) -> tuple[int, int]:
        return self.reranker.budget

    def _compute(self, items: list) -> tuple[np.ndarray, list[MicroBatch]]:
        scores, batches = self.reranker.score(items)
        return np.asarray(scores, dtype=np.float32).reshape(-1, 1), batches
