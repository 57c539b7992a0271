"""Query-document relevance scores: cross-encoder logits or bi-encoder cosine similarity.

`load_reranker` picks the kind from `RerankConfig.mode`; both kinds share the
tokenize / score / predict API so a server can tokenize per request and score the items
of many requests together.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError
from backend_lib.encoder.batching import MicroBatch, run_micro_batches
from backend_lib.encoder.config import RerankConfig
from backend_lib.encoder.embedder import (
    Embedder,
    Encoder,
    load_encoder,
    settle_batch_tokens,
    settle_max_length,
)
from backend_lib.encoder.packed_bert import ClassifierHead, EncoderArchitecture
from backend_lib.encoder.packed_decoder import DecoderArchitecture, LastTokenScoreHead, is_decoder
from backend_lib.encoder.packed_tokens import pack
from backend_lib.encoder.pair_template import ChatPairTokenizer
from backend_lib.encoder.st_config import (
    LogitScoreTokens,
    module_kinds,
    read_cross_encoder_activation,
    read_logit_score,
    read_max_seq_length,
    read_prompts,
)
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.errors import InputError

PairItem = tuple[list[int], list[int] | None]  # cross-encoder: (token ids, token type ids)
TextPairItem = tuple[list[int], list[int]]  # bi-encoder: (query ids, document ids)


def _activate(raw: np.ndarray, activation: str) -> np.ndarray:
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-raw.astype(np.float64)))).astype(np.float32)
    if activation == "tanh":
        return np.tanh(raw).astype(np.float32)
    return raw


def _choose_activation(default: str, apply_sigmoid: bool | None) -> str:
    """None keeps `default`; True forces sigmoid; False gives the raw score."""
    if apply_sigmoid is None:
        return default
    return "sigmoid" if apply_sigmoid else "identity"


class CrossEncoderReranker:
    """Scores (query, document) pairs jointly with a one-label sequence classifier, or a causal
    LM's token logits at the last token, as `sentence_transformers.CrossEncoder.predict` does."""

    def __init__(
        self,
        encoder: Encoder,
        head: ClassifierHead | LastTokenScoreHead,
        pairs: TextTokenizer | ChatPairTokenizer,
        activation: str,
        config: RerankConfig,
    ):
        self.encoder, self.head, self.pairs = encoder, head, pairs
        self.activation, self.config = activation, config
        self.max_seq_length = pairs.max_length

    @classmethod
    def from_config(
        cls, config: RerankConfig, device: torch.device, base_dir: Path
    ) -> CrossEncoderReranker:
        model_dir, arch, weights, encoder = load_encoder(config, device, base_dir)
        causal = isinstance(arch, DecoderArchitecture) and not arch.architecture.endswith(
            "ForSequenceClassification"
        )
        if not causal and arch.num_labels != 1:
            raise ConfigError(
                "model",
                config.model,
                f"a reranker needs one label, the checkpoint has {arch.num_labels}",
            )
        tokenizer = TextTokenizer(model_dir, config.max_text_bytes)
        length = settle_max_length(
            config, tokenizer, arch, read_max_seq_length(model_dir, config.model)
        )
        settle_batch_tokens(config, length, device)
        activation = read_cross_encoder_activation(
            model_dir, config.model, 1 if causal else arch.num_labels
        )
        activation = _choose_activation(activation, config.apply_sigmoid)
        if weights is not None:
            head, pairs = ClassifierHead(weights, arch), tokenizer
        elif not causal:
            head = LastTokenScoreHead.read(model_dir, arch, encoder, config.model)
            pairs = tokenizer
        else:
            head, pairs = _causal_lm_scoring(config, model_dir, base_dir, encoder, tokenizer)
        return cls(encoder, head, pairs, activation, config)

    @property
    def budget(self) -> tuple[int, int]:
        """(max_batch_tokens, max_batch_size) of one micro-batch."""
        return self.config.max_batch_tokens, self.config.max_batch_size

    def tokenize(
        self, queries: Sequence[str], documents: Sequence[str], truncate: bool | None = None
    ) -> list[PairItem]:
        """One item per pair: query and document joined with the model's special tokens (a
        causal-LM reranker: rendered with its chat template)."""
        return self.pairs.encode_pairs(
            queries, documents, self.config.truncate if truncate is None else truncate
        )

    @staticmethod
    def num_tokens(item: PairItem) -> int:
        """The tokens of one pair: query and document joined (truncated as tokenized)."""
        return len(item[0])

    def score(
        self, items: Sequence[PairItem], apply_sigmoid: bool | None = None
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N] float32 scores in input order, and what each micro-batch did."""
        lengths = [len(ids) for ids, _ in items]
        for i, length in enumerate(lengths):
            if not 0 < length <= self.max_seq_length:
                raise InputError(f"item {i} has {length} tokens; expected 1..{self.max_seq_length}")
        logits = np.empty(len(items), dtype=np.float32)

        @torch.inference_mode()
        def compute(indices: list[int]) -> np.ndarray:
            chosen = [items[i] for i in indices]
            types = None if any(t is None for _, t in chosen) else [t for _, t in chosen]
            tokens = pack([ids for ids, _ in chosen], self.encoder.device, types)
            return self.head(self.encoder, tokens)[:, 0].float().cpu().numpy()

        batches = run_micro_batches(
            lengths, self.config.max_batch_tokens, self.config.max_batch_size, compute, logits
        )
        return _activate(logits, _choose_activation(self.activation, apply_sigmoid)), batches

    def predict(
        self, queries: Sequence[str], documents: Sequence[str], apply_sigmoid: bool | None = None
    ) -> np.ndarray:
        return self.score(self.tokenize(queries, documents), apply_sigmoid)[0]


class BiEncoderReranker:
    """Scores a pair by the cosine similarity of the embedding model's two vectors."""

    def __init__(self, embedder: Embedder, activation: str = "identity"):
        self.embedder, self.activation = embedder, activation
        self.max_seq_length = embedder.max_seq_length

    @property
    def budget(self) -> tuple[int, int]:
        """(max_batch_tokens, max_batch_size) of one micro-batch: the embedder's."""
        return self.embedder.max_batch_tokens, self.embedder.max_batch_size

    @classmethod
    def from_config(
        cls, config: RerankConfig, device: torch.device, base_dir: Path
    ) -> BiEncoderReranker:
        embedder = Embedder.from_config(config, device, base_dir)
        return cls(embedder, _choose_activation("identity", config.apply_sigmoid))

    def tokenize(
        self, queries: Sequence[str], documents: Sequence[str], truncate: bool | None = None
    ) -> list[TextPairItem]:
        """One item per pair: (query token ids, document token ids)."""
        if len(queries) != len(documents):
            raise InputError(
                f"got {len(queries)} queries but {len(documents)} documents; they must pair up"
            )
        return list(
            zip(
                self.embedder.tokenize(queries, truncate),
                self.embedder.tokenize(documents, truncate),
                strict=True,
            )
        )

    @staticmethod
    def num_tokens(item: TextPairItem) -> int:
        """The tokens of one pair: the query's plus the document's (each truncated on its own)."""
        return len(item[0]) + len(item[1])

    def score(
        self, items: Sequence[TextPairItem], apply_sigmoid: bool | None = None
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N] float32 cosine similarities (sigmoid applied only when forced).

        Each distinct text is embedded once (a query shared by many documents costs one
        row). A micro-batch's `indices` are the pairs with a text in it (a pair whose
        query and document went to different micro-batches is listed in both); its token
        counts are those of the texts it embedded.
        """
        distinct: dict[tuple[int, ...], int] = {}
        rows = np.empty((len(items), 2), dtype=np.int64)
        for i, (query, document) in enumerate(items):
            rows[i, 0] = distinct.setdefault(tuple(query), len(distinct))
            rows[i, 1] = distinct.setdefault(tuple(document), len(distinct))
        vectors, text_batches = self.embedder.embed([list(ids) for ids in distinct], normalize=True)
        cosine = np.einsum("ij,ij->i", vectors[rows[:, 0]], vectors[rows[:, 1]])
        activation = _choose_activation(self.activation, apply_sigmoid)
        return _activate(cosine.astype(np.float32), activation), _per_pair(text_batches, rows)

    def predict(
        self, queries: Sequence[str], documents: Sequence[str], apply_sigmoid: bool | None = None
    ) -> np.ndarray:
        return self.score(self.tokenize(queries, documents), apply_sigmoid)[0]


def _per_pair(text_batches: list[MicroBatch], rows: np.ndarray) -> list[MicroBatch]:
    """Re-express micro-batches of distinct texts in terms of the pairs using them."""
    out = []
    for batch in text_batches:
        in_batch = np.isin(rows, batch.indices).any(axis=1)
        pairs = np.flatnonzero(in_batch).tolist()
        out.append(MicroBatch(pairs, batch.padded_tokens, batch.real_tokens, batch.seconds))
    return out


def _causal_lm_scoring(
    config: RerankConfig,
    model_dir: Path,
    base_dir: Path,
    encoder: Encoder,
    tokenizer: TextTokenizer,
) -> tuple[LastTokenScoreHead, ChatPairTokenizer]:
    """The score head and pair renderer of a causal-LM reranker (Qwen3-Reranker form)."""
    tokens = _logit_score_tokens(config, model_dir, tokenizer)
    head = LastTokenScoreHead.from_token_logits(
        model_dir, encoder, tokens.true_token_id, tokens.false_token_id, config.model
    )
    template = None
    if config.chat_template:
        path = base_dir / config.chat_template
        if not path.is_file():
            raise ConfigError("chat_template", config.chat_template, f"no such file: {path}")
        template = path.read_text(encoding="utf-8")
    prompts, default = read_prompts(model_dir, config.model)
    system = prompts[default] if default is not None else None
    return head, ChatPairTokenizer(tokenizer, template, system, config.model)


def _logit_score_tokens(
    config: RerankConfig, model_dir: Path, tokenizer: TextTokenizer
) -> LogitScoreTokens:
    """`classifier_from_token` if set, else the checkpoint's LogitScore module, else the tokens
    "yes" / "no" (what sentence-transformers assumes for a bare causal LM)."""
    names = config.classifier_tokens
    if not names:
        found = read_logit_score(model_dir, config.model)
        if found is not None:
            return found
        names = ("no", "yes")
    ids = tokenizer.tokenizer.convert_tokens_to_ids(list(names))
    missing = [n for n, i in zip(names, ids, strict=True) if i is None]
    if missing:
        raise ConfigError(
            "classifier_from_token",
            config.classifier_from_token or json.dumps(list(names)),
            f"the tokenizer has no token {', '.join(map(repr, missing))}",
        )
    return LogitScoreTokens(ids[-1], ids[0] if len(ids) == 2 else None)


Reranker = CrossEncoderReranker | BiEncoderReranker


def load_reranker(config: RerankConfig, device: torch.device, base_dir: Path) -> Reranker:
    """A cross-encoder for `*ForSequenceClassification` checkpoints and causal-LM rerankers (mode
    auto), else a bi-encoder over the embedding model."""
    mode = config.mode
    if mode == "auto":
        model_dir = resolve_model_path(config.model, base_dir)
        reader = DecoderArchitecture if is_decoder(model_dir) else EncoderArchitecture
        architecture = reader.read(model_dir, config.model).architecture
        kinds = module_kinds(model_dir, config.model)
        # A causal LM scores pairs unless it is an embedder (a Pooling module), as in
        # sentence-transformers, whose CrossEncoder reads any *ForCausalLM as a reranker.
        causal = architecture.endswith("ForCausalLM") and "Pooling" not in kinds
        mode = (
            "cross_encoder"
            if architecture.endswith("ForSequenceClassification") or causal or "LogitScore" in kinds
            else "bi_encoder"
        )
    if mode == "cross_encoder":
        return CrossEncoderReranker.from_config(config, device, base_dir)
    return BiEncoderReranker.from_config(config, device, base_dir)
