"""Text embeddings as sentence-transformers computes them, on the packed encoder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import require
from backend_lib.device import resolve_dtype
from backend_lib.encoder.batching import MicroBatch, run_micro_batches
from backend_lib.encoder.config import EncoderSettings, auto_max_batch_tokens
from backend_lib.encoder.packed_bert import EncoderArchitecture, PackedBertEncoder
from backend_lib.encoder.packed_tokens import pack
from backend_lib.encoder.pooling import pool
from backend_lib.encoder.st_config import EmbeddingLayout, read_embedding_layout
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.encoder.weights import CheckpointWeights
from backend_lib.errors import InputError


def settle_max_length(
    settings: EncoderSettings,
    tokenizer: TextTokenizer,
    arch: EncoderArchitecture,
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


def load_encoder(
    settings: EncoderSettings, device: torch.device, base_dir: Path
) -> tuple[Path, EncoderArchitecture, CheckpointWeights, PackedBertEncoder]:
    """Resolve the checkpoint and load its encoder weights in the configured dtype."""
    model_dir = resolve_model_path(settings.model, base_dir)
    arch = EncoderArchitecture.read(model_dir, settings.model)
    weights = CheckpointWeights(
        model_dir, resolve_dtype(settings.dtype, device), device, settings.model
    )
    return model_dir, arch, weights, PackedBertEncoder(weights, arch)


class Embedder:
    """Embeds texts: tokenize -> packed encoder -> pooling -> optional L2 normalisation.

    `tokenize` and `embed` are separate so a server can tokenize each request on its own
    (a bad request fails alone) and then embed the items of many requests together.
    """

    def __init__(
        self,
        encoder: PackedBertEncoder,
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

    def tokenize(self, texts: Sequence[str], truncate: bool | None = None) -> list[list[int]]:
        """Token ids per text; `InputError` names the offending item."""
        return self.tokenizer.encode_texts(
            texts, self.truncate_default if truncate is None else truncate
        )

    def check_token_ids(self, items: Sequence[Sequence[int]]) -> list[list[int]]:
        """Token-id items a caller sent, as they are: each id must be in the vocabulary and each
        item 1..max_seq_length tokens long (never truncated: which end to cut is the caller's
        choice, and cutting drops the special tokens it chose). `InputError` names the item."""
        vocab = self.encoder.arch.vocab_size
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

    def embed(
        self, token_ids: Sequence[Sequence[int]], normalize: bool | None = None
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N, dim] float32 embeddings in input order, and what each micro-batch did."""
        lengths = [len(ids) for ids in token_ids]
        for i, length in enumerate(lengths):
            if not 0 < length <= self.max_seq_length:
                raise InputError(f"item {i} has {length} tokens; expected 1..{self.max_seq_length}")
        unit = self.normalize_default if normalize is None else normalize
        out = np.empty((len(token_ids), self.dim), dtype=np.float32)

        @torch.inference_mode()
        def compute(indices: list[int]) -> np.ndarray:
            tokens = pack([token_ids[i] for i in indices], self.encoder.device)
            vectors = pool(self.encoder(tokens), tokens, self.layout.pooling_modes)
            if unit:
                vectors = F.normalize(vectors, p=2, dim=1)
            return vectors.cpu().numpy()

        batches = run_micro_batches(
            lengths, self.max_batch_tokens, self.max_batch_size, compute, out
        )
        return out, batches

    def encode(
        self, texts: Sequence[str], normalize: bool | None = None, truncate: bool | None = None
    ) -> np.ndarray:
        """Tokenize and embed: [N, dim] float32."""
        return self.embed(self.tokenize(texts, truncate), normalize)[0]
