"""Text embeddings as sentence-transformers computes them, on the packed encoder."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError, require
from backend_lib.device import resolve_dtype
from backend_lib.encoder.batching import MicroBatch, run_micro_batches
from backend_lib.encoder.config import EncoderSettings, auto_max_batch_tokens
from backend_lib.encoder.packed_bert import EncoderArchitecture, PackedBertEncoder
from backend_lib.encoder.packed_decoder import (
    DecoderArchitecture,
    PackedDecoderEncoder,
    is_decoder,
)
from backend_lib.encoder.packed_tokens import pack
from backend_lib.encoder.pooling import pool
from backend_lib.encoder.st_config import EmbeddingLayout, read_embedding_layout
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.encoder.weights import CheckpointWeights
from backend_lib.errors import InputError


def settle_max_length(
    settings: EncoderSettings,
    tokenizer: TextTokenizer,
    arch: EncoderArchitecture | DecoderArchitecture,
    checkpoint_value: int | None = None,
) -> int:
    """Set and return the tokens-per-item limit.

    The configured `max_seq_length` if any (it must fit the position table), else what
    sentence-transformers uses: the checkpoint's sentence-transformers value, or the
    tokenizer's `model_max_length` capped at `max_position_embeddings`; the default is
    further capped at the position table (RoBERTa positions start after padding_idx).
    """
    if settings.max_seq_length:
        length = settings.max_seq_length
        require(
            length <= arch.max_tokens,
            "max_seq_length",
            length,
            f"the checkpoint's position embeddings hold at most {arch.max_tokens} tokens",
        )
    else:
        default = checkpoint_value or min(tokenizer.model_max_length, arch.max_position_embeddings)
        length = min(default, arch.max_tokens)
    tokenizer.max_length = length
    return length


def settle_batch_tokens(
    settings: EncoderSettings, max_seq_length: int, device: torch.device
) -> int:
    """Set and return the micro-batch budget: the configured `max_batch_tokens`, which must hold
    one item of `max_seq_length` tokens, or the device's auto value (`auto_max_batch_tokens`)."""
    if settings.max_batch_tokens == 0:
        settings.max_batch_tokens = auto_max_batch_tokens(torch.device(device).type, max_seq_length)
    require(
        max_seq_length <= settings.max_batch_tokens,
        "max_batch_tokens",
        settings.max_batch_tokens,
        f"must hold one item of max_seq_length={max_seq_length} tokens",
    )
    return settings.max_batch_tokens


Encoder = PackedBertEncoder | PackedDecoderEncoder
"""Token ids in, hidden states out, packed: [T] -> [T, hidden_size] (`encoder(tokens)`)."""


def load_encoder(
    settings: EncoderSettings, device: torch.device, base_dir: Path
) -> tuple[Path, EncoderArchitecture | DecoderArchitecture, CheckpointWeights | None, Encoder]:
    """Resolve the checkpoint and load its encoder in the configured dtype: the packed BERT for
    the BERT family, the LLM engine's forward for decoder bodies (their weights then None: the
    decoder reads its heads itself)."""
    model_dir = resolve_model_path(settings.model, base_dir)
    dtype = resolve_dtype(settings.dtype, device)
    if is_decoder(model_dir):
        arch = DecoderArchitecture.read(model_dir, settings.model)
        return (
            model_dir,
            arch,
            None,
            PackedDecoderEncoder(model_dir, arch, dtype, device, settings.model),
        )
    arch = EncoderArchitecture.read(model_dir, settings.model)
    weights = CheckpointWeights(model_dir, dtype, device, settings.model)
    return model_dir, arch, weights, PackedBertEncoder(weights, arch)


class PromptLayout(Protocol):
    """The part of a checkpoint's layout (`EmbeddingLayout`, `SparseLayout`) prompts come from."""

    @property
    def prompts(self) -> dict[str, str]: ...

    @property
    def default_prompt_name(self) -> str | None: ...


class EmbedderInputs:
    """What the dense (`Embedder`) and sparse (`backend_lib.encoder.sparse.SparseEmbedder`)
    embedders do before the model: texts, with the checkpoint's prompts, or token-id items to
    token ids. A subclass sets `tokenizer`, `layout` (its `prompts`, `default_prompt_name`),
    `truncate_default`, `max_seq_length` and `encoder` (or overrides `vocab_size`).

    Tokenizing and computing are separate so a server can tokenize each request on its own
    (a bad request fails alone) and then compute the items of many requests together.
    """

    tokenizer: TextTokenizer
    layout: PromptLayout
    truncate_default: bool
    max_seq_length: int
    encoder: Encoder

    def tokenize(
        self, texts: Sequence[str], truncate: bool | None = None, prompt: str | None = None
    ) -> list[list[int]]:
        """Token ids per text, `prompt` (a `resolve_prompt` text) prepended to each as
        sentence-transformers does; `InputError` names the offending item."""
        if prompt:
            texts = [prompt + text if isinstance(text, str) else text for text in texts]
        return self.tokenizer.encode_texts(
            texts, self.truncate_default if truncate is None else truncate
        )

    def resolve_prompt(self, name: str | None) -> str | None:
        """The prompt text of prompt `name`; for None the checkpoint's `default_prompt_name`'s, if
        it has one (sentence-transformers' `encode(prompt_name=...)`). `InputError` lists the
        prompt names when the model lacks `name`."""
        prompts = self.layout.prompts
        if name is None:
            default = self.layout.default_prompt_name
            return prompts[default] if default is not None else None
        if name not in prompts:
            allowed = ", ".join(f"'{p}'" for p in prompts) if prompts else None
            raise InputError(
                f"'prompt_name' '{name}' is not one of this model's prompts: {allowed}"
                if allowed
                else f"'prompt_name' '{name}': this model has no prompts"
            )
        return prompts[name]

    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size)."""
        return self.encoder.arch.vocab_size

    def check_token_ids(self, items: Sequence[Sequence[int]]) -> list[list[int]]:
        """Token-id items a caller sent, as they are: each id must be in the vocabulary and each
        item 1..max_seq_length tokens long (never truncated: which end to cut is the caller's
        choice, and cutting drops the special tokens it chose). `InputError` names the item."""
        vocab = self.vocab_size
        for i, ids in enumerate(items):
            if not 0 < len(ids) <= self.max_seq_length:
                raise InputError(
                    f"item {i} has {len(ids)} token ids; expected 1..{self.max_seq_length} "
                    "(max_seq_length; token ids are never truncated)"
                )
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"item {i}: token id {bad} is outside the vocabulary [0, {vocab})")
        return [list(ids) for ids in items]


class VectorSizes:
    """The sizes a dense embedder's vectors may be asked for. A subclass sets `dim` (the full
    size) and `dimensions` (the sizes allowed, ascending, `dim` among them)."""

    dim: int
    dimensions: tuple[int, ...]

    def check_dimensions(self, dimensions: int | None) -> int:
        """The vector size of a request: `dimensions` if it is one of `self.dimensions`, the
        full size for None; `InputError` lists the allowed sizes."""
        if dimensions is None:
            return self.dim
        if dimensions not in self.dimensions:
            allowed = ", ".join(str(d) for d in self.dimensions)
            raise InputError(
                f"'dimensions' {dimensions} is not one of this model's sizes: {allowed}"
            )
        return dimensions


class Embedder(EmbedderInputs, VectorSizes):
    """Embeds texts: tokenize -> packed encoder -> pooling -> optional L2 normalisation."""

    def __init__(
        self,
        encoder: Encoder,
        tokenizer: TextTokenizer,
        layout: EmbeddingLayout,
        normalize_default: bool,
        truncate_default: bool,
        max_batch_tokens: int,
        max_batch_size: int,
    ):
        self.encoder, self.tokenizer, self.layout = encoder, tokenizer, layout
        self.normalize_default, self.truncate_default = normalize_default, truncate_default
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_seq_length = tokenizer.max_length
        self.dim = encoder.arch.hidden_size * len(layout.pooling_modes)
        too_big = [d for d in layout.matryoshka_dimensions if d > self.dim]
        if too_big:
            raise ConfigError(
                "model",
                f"matryoshka_dimensions={list(layout.matryoshka_dimensions)}",
                f"{too_big} exceed the model's {self.dim} dimensions",
            )
        self.dimensions = tuple(sorted({*layout.matryoshka_dimensions, self.dim}))
        """The sizes a request may ask for: the declared Matryoshka sizes and the full one."""
        self._prompt_skips: dict[str, int] = {}
        self._last_token_only = layout.pooling_modes == ("lasttoken",) and isinstance(
            encoder, PackedDecoderEncoder
        )

    @classmethod
    def from_config(cls, config: EncoderSettings, device: torch.device, base_dir: Path) -> Embedder:
        """Load the checkpoint `config.model` (see `EmbeddingConfig` for the settings).

        Also accepts a `RerankConfig`, for the bi-encoder reranker (never normalizes by
        default there; cosine scoring normalizes itself).
        """
        model_dir, arch, _, encoder = load_encoder(config, device, base_dir)
        layout = read_embedding_layout(model_dir, config.model)
        tokenizer = TextTokenizer(model_dir, config.max_text_bytes, layout.do_lower_case)
        length = settle_max_length(config, tokenizer, arch, layout.max_seq_length)
        settle_batch_tokens(config, length, device)
        normalize = getattr(config, "normalize", None)
        return cls(
            encoder,
            tokenizer,
            layout,
            normalize_default=layout.normalize if normalize is None else normalize,
            truncate_default=config.truncate,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
        )

    def pool_skip(self, prompt: str | None) -> int:
        """Leading tokens of an item with `prompt` that pooling leaves out: the prompt's tokens,
        its [CLS] included, when the Pooling module says `include_prompt: false`; else 0.
        Measured as sentence-transformers does: the prompt alone, less a trailing special token."""
        if not prompt or self.layout.include_prompt:
            return 0
        if prompt not in self._prompt_skips:
            ids = self.tokenizer.encode_texts([prompt], truncate=True)[0]
            special = set(self.tokenizer.tokenizer.all_special_ids)
            self._prompt_skips[prompt] = len(ids) - (1 if ids and ids[-1] in special else 0)
        return self._prompt_skips[prompt]

    def embed(
        self,
        token_ids: Sequence[Sequence[int]],
        normalize: bool | None = None,
        skip: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N, dim] float32 embeddings in input order, and what each micro-batch did. `skip[i]`:
        leading tokens of item i left out of pooling (`pool_skip`; at least one token is kept)."""
        lengths = [len(ids) for ids in token_ids]
        for i, length in enumerate(lengths):
            if not 0 < length <= self.max_seq_length:
                raise InputError(f"item {i} has {length} tokens; expected 1..{self.max_seq_length}")
        skips = None
        if skip is not None and any(skip):
            skips = [min(s, length - 1) for s, length in zip(skip, lengths, strict=True)]
        unit = self.normalize_default if normalize is None else normalize

        def vectors(indices: list[int]) -> torch.Tensor:
            tokens = pack([token_ids[i] for i in indices], self.encoder.device)
            cut = None
            if skips is not None:
                cut = torch.tensor([skips[i] for i in indices], dtype=torch.long)
                cut = cut.to(self.encoder.device)
            if self._last_token_only:
                # Only the last tokens' states are needed: the decoder's last layer runs on those.
                return self.encoder(tokens, tokens.starts + tokens.lengths_t - 1)
            return pool(self.encoder(tokens), tokens, self.layout.pooling_modes, cut)

        budget = (self.max_batch_tokens, self.max_batch_size)
        return embed_in_micro_batches(lengths, budget, self.dim, vectors, unit)

    def encode(
        self,
        texts: Sequence[str],
        normalize: bool | None = None,
        truncate: bool | None = None,
        prompt_name: str | None = None,
        dimensions: int | None = None,
    ) -> np.ndarray:
        """Tokenize (with the prompt `prompt_name`, or the default one) and embed:
        [N, dimensions or dim] float32 (see `reduce`)."""
        size = self.check_dimensions(dimensions)
        prompt = self.resolve_prompt(prompt_name)
        tokens = self.tokenize(texts, truncate, prompt)
        vectors = self.embed(tokens, normalize, [self.pool_skip(prompt)] * len(tokens))[0]
        unit = self.normalize_default if normalize is None else normalize
        return reduce(vectors, size, [unit] * len(vectors))


def embed_in_micro_batches(
    lengths: Sequence[int],
    budget: tuple[int, int],
    dim: int,
    vectors: Callable[[list[int]], torch.Tensor],
    unit: bool,
) -> tuple[np.ndarray, list[MicroBatch]]:
    """[len(lengths), dim] float32 rows in input order, and what each micro-batch did: items of
    `lengths` tokens planned into micro-batches within `budget` (max_batch_tokens,
    max_batch_size), each computed by `vectors(indices)` ([len(indices), dim], any float dtype)
    under inference mode, rows L2-normalised when `unit`."""
    out = np.empty((len(lengths), dim), dtype=np.float32)

    @torch.inference_mode()
    def compute(indices: list[int]) -> np.ndarray:
        rows = vectors(indices).float()
        if unit:
            rows = F.normalize(rows, p=2, dim=1)
        return rows.cpu().numpy()

    return out, run_micro_batches(lengths, *budget, compute, out)


def reduce(vectors: np.ndarray, dimensions: int, unit: Sequence[bool]) -> np.ndarray:
    """[N, D] vectors cut to their first `dimensions` components, each row `unit[i]` rescaled to
    unit length again (sentence-transformers' `truncate_dim`, then normalising)."""
    if dimensions == vectors.shape[1]:
        return vectors
    out = np.ascontiguousarray(vectors[:, :dimensions])
    rows = np.asarray(unit, dtype=bool)
    if rows.any():
        norms = np.linalg.norm(out[rows], axis=1, keepdims=True)
        out[rows] = out[rows] / np.maximum(norms, 1e-12)
    return out
