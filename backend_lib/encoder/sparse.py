"""SPLADE sparse embeddings, as sentence-transformers' `SparseEncoder` computes them.

A `*ForMaskedLM` checkpoint's masked-LM head turns the packed encoder's [tokens, hidden] states
into [tokens, vocab] logits; each text's vector is log(1 + ReLU(logit)) pooled over its tokens
(max or sum), vocabulary-sized and mostly zeros, so only its nonzero entries are kept: vocabulary
ids ascending and their float32 weights.

The layout comes from the checkpoint's sentence-transformers files: modules.json lists
MLMTransformer (or a Transformer whose sentence_bert_config.json says `transformer_task:
fill-mask`) then SpladePooling, whose config.json gives `pooling_strategy` and
`activation_function`; prompts and `max_active_dims` are config_sentence_transformers.json's. A
`*ForMaskedLM` checkpoint without modules.json, served with `mode: sparse`, gets SparseEncoder's
defaults for one (max pooling, relu).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from backend_lib.checkpoint import resolve_model_path
from backend_lib.config import ConfigError, require
from backend_lib.contract import SPARSE_PAD_INDEX
from backend_lib.encoder.batching import MicroBatch, run_micro_batches
from backend_lib.encoder.config import EmbeddingConfig
from backend_lib.encoder.embedder import (
    EmbedderInputs,
    load_encoder,
    settle_batch_tokens,
    settle_max_length,
)
from backend_lib.encoder.packed_bert import EncoderArchitecture, PackedBertEncoder
from backend_lib.encoder.packed_tokens import PackedTokens, pack
from backend_lib.encoder.st_config import (
    module_kind,
    module_kinds,
    read_json,
    read_prompts,
    sentence_bert_config,
)
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.encoder.weights import CheckpointWeights
from backend_lib.errors import InputError
from backend_lib.linear import Linear

HEAD_CHUNK_TOKENS = 512
"""Token rows of the [tokens, vocab] logits computed at a time: 512 x 30522 float32 is 62 MB,
where a 4096-token micro-batch's whole matrix would be 500 MB."""
POOLING_STRATEGIES = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")
"""SpladePooling's `activation_function`: log(1 + ReLU(x)), or log1p once more (OpenSearch's)."""
_TRANSFORMER_TASKS = {"MLMTransformer": "fill-mask", "Transformer": "feature-extraction"}
"""The first modules SPLADE may follow, with their default `transformer_task`."""


@dataclass(frozen=True)
class SparseLayout:
    """Inference settings of a SPLADE checkpoint."""

    pooling_strategy: str = "max"  # over each text's tokens: "max" or "sum"
    activation: str = "relu"  # one of ACTIVATIONS
    max_seq_length: int | None = None  # None: not set by the sentence-transformers files
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)  # prompt name -> text prepended
    default_prompt_name: str | None = None
    max_active_dims: int | None = None  # keep only each vector's largest weights (None: all)
    dimension: int | None = None  # SpladePooling's embedding_dimension, if it says (the vocab)


class SparseVector(NamedTuple):
    """One text's SPLADE vector: its nonzero entries."""

    indices: np.ndarray  # [nnz] int64 vocabulary ids, ascending
    values: np.ndarray  # [nnz] float32 weights, each > 0


def serves_sparse(config: EmbeddingConfig, base_dir: Path) -> bool:
    """Whether `config` serves sparse vectors: `mode` sparse, or auto and the checkpoint's
    modules.json holds a SpladePooling module."""
    if config.mode != "auto":
        return config.mode == "sparse"
    model_dir = resolve_model_path(config.model, base_dir)
    return "SpladePooling" in module_kinds(model_dir, config.model)


def read_sparse_layout(model_dir: Path, spec: str) -> SparseLayout:
    """Read the SPLADE settings of a checkpoint; other module pipelines are errors."""
    st_bert = sentence_bert_config(model_dir, spec)
    sequence: dict[str, Any] = dict(
        max_seq_length=st_bert.get("max_seq_length"),
        do_lower_case=bool(st_bert.get("do_lower_case", False)),
    )
    if not (model_dir / "modules.json").is_file():
        return SparseLayout(**sequence)

    modules = sorted(read_json(model_dir / "modules.json", spec), key=lambda m: m.get("idx", 0))
    kinds = [module_kind(m) for m in modules]
    if (
        len(kinds) != 2
        or kinds[0] not in _TRANSFORMER_TASKS
        or kinds[1] != "SpladePooling"
        or modules[0].get("path", "") not in ("", ".")
    ):
        raise ConfigError(
            "model",
            spec,
            "sparse embeddings need modules.json to list MLMTransformer (stored at the model "
            f"root) then SpladePooling; it lists {kinds}",
        )
    task = st_bert.get("transformer_task", _TRANSFORMER_TASKS[kinds[0]])
    if task != "fill-mask":
        raise ConfigError(
            "model", spec, f"transformer_task '{task}' before SpladePooling: expected 'fill-mask'"
        )
    pooling = read_json(model_dir / modules[1].get("path", "") / "config.json", spec)
    strategy = pooling.get("pooling_strategy", "max")
    activation = pooling.get("activation_function", "relu")
    if strategy not in POOLING_STRATEGIES:
        raise ConfigError(
            "model", spec, f"SpladePooling pooling_strategy '{strategy}' is not max or sum"
        )
    if activation not in ACTIVATIONS:
        raise ConfigError(
            "model",
            spec,
            f"SpladePooling activation_function '{activation}' is not one of {', '.join(ACTIVATIONS)}",
        )
    prompts, default_prompt_name = read_prompts(model_dir, spec)
    return SparseLayout(
        strategy,
        activation,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        max_active_dims=_max_active_dims(model_dir, spec),
        # sentence-transformers 5.0 wrote `word_embedding_dimension`, later ones this.
        dimension=pooling.get("embedding_dimension", pooling.get("word_embedding_dimension")),
        **sequence,
    )


def _max_active_dims(model_dir: Path, spec: str) -> int | None:
    path = model_dir / "config_sentence_transformers.json"
    value = (read_json(path, spec) if path.is_file() else {}).get("max_active_dims")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError("model", spec, f"max_active_dims must be an integer >= 1, got {value!r}")
    return value


class MaskedLMHead:
    """A `*ForMaskedLM` checkpoint's head, as transformers computes it: [T, hidden] -> [T, vocab].

    BERT: `cls.predictions.transform.dense` -> hidden_act -> `transform.LayerNorm` -> decoder
    + `cls.predictions.bias`. RoBERTa family: `lm_head.dense` -> exact GELU (whatever hidden_act
    says) -> `lm_head.layer_norm` -> decoder + `lm_head.bias`. The decoder weight is the word
    embeddings where the checkpoint ties them (then none is stored).
    """

    _PREFIXES = {
        "bert": ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm"),
        "roberta": ("lm_head.dense", "lm_head.layer_norm"),
    }
    _HEAD = {"bert": "cls.predictions", "roberta": "lm_head"}

    def __init__(
        self,
        weights: CheckpointWeights,
        arch: EncoderArchitecture,
        word_embeddings: torch.Tensor,
        tied: bool,
    ):
        dense, norm = self._PREFIXES[arch.family]
        head = self._HEAD[arch.family]
        if not weights.has(f"{dense}.weight", False):
            raise ConfigError(
                "model",
                weights.spec,
                f"sparse embeddings need a *ForMaskedLM checkpoint: no '{dense}.weight' tensor",
            )

        def get(name: str) -> torch.Tensor:
            return weights.get(name, prefixed=False)

        activation = arch.hidden_act if arch.family == "bert" else "gelu"
        self.dense = Linear(get(f"{dense}.weight"), get(f"{dense}.bias"), activation)
        self.norm_weight, self.norm_bias = get(f"{norm}.weight"), get(f"{norm}.bias")
        self.eps = arch.layer_norm_eps
        if weights.has(f"{head}.decoder.weight", False):
            decoder = get(f"{head}.decoder.weight")
        elif tied:
            decoder = word_embeddings
        else:
            raise ConfigError(
                "model",
                weights.spec,
                f"no '{head}.decoder.weight' tensor and config.json unties it from the embeddings",
            )
        # transformers ties the decoder's bias to the head's own `bias`; either may be stored.
        stored = (b for b in (f"{head}.bias", f"{head}.decoder.bias") if weights.has(b, False))
        bias = next(stored, f"{head}.bias")  # none: `get` names the missing tensor
        self.decoder = Linear(decoder, get(bias))

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] states -> [T, hidden] inputs of the decoder."""
        x = self.dense(hidden)
        return F.layer_norm(x, self.norm_weight.shape, self.norm_weight, self.norm_bias, self.eps)

    def decode(self, transformed: torch.Tensor) -> torch.Tensor:
        """[T, hidden] transformed states -> [T, vocab] logits."""
        return self.decoder(transformed)


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """SpladePooling's activation of logits (or of pooled maxima), in place on a fresh tensor."""
    y = torch.relu(x).log1p_()
    return y.log1p_() if activation == "log1p_relu" else y


def splade_pool(
    hidden: torch.Tensor, tokens: PackedTokens, head: MaskedLMHead, layout: SparseLayout
) -> torch.Tensor:
    """[T, hidden] packed states -> [B, vocab] float32 SPLADE vectors (dense, mostly zeros).

    The head's [T, vocab] logits are computed HEAD_CHUNK_TOKENS rows at a time and reduced into
    each row's sequence as they come, so the whole matrix never exists.
    """
    owners = torch.repeat_interleave(
        torch.arange(len(tokens.lengths), device=hidden.device),
        tokens.lengths_t,
        output_size=tokens.num_tokens,
    )
    is_max = layout.pooling_strategy == "max"
    vocab = head.decoder.out_features
    pooled = torch.full(
        (len(tokens.lengths), vocab),
        float("-inf") if is_max else 0.0,
        dtype=torch.float32,
        device=hidden.device,
    )
    transformed = head.transform(hidden)
    for start in range(0, tokens.num_tokens, HEAD_CHUNK_TOKENS):
        rows = slice(start, start + HEAD_CHUNK_TOKENS)
        logits = head.decode(transformed[rows]).float()
        if is_max:
            # The activation never decreases as its input grows, so the max of the activated logits
            # is the activation of the max logit: reduce raw logits, activate once per vector.
            index = owners[rows].unsqueeze(1).expand_as(logits)
            pooled.scatter_reduce_(0, index, logits, "amax")
        else:
            pooled.index_add_(0, owners[rows], _activate(logits, layout.activation))
    return _activate(pooled, layout.activation) if is_max else pooled


def to_sparse(pooled: torch.Tensor, max_active_dims: int | None = None) -> list[SparseVector]:
    """The nonzero entries of each row of [B, vocab] vectors; with `max_active_dims`, only the
    largest that many of each (sentence-transformers' `max_active_dims`)."""
    if max_active_dims is not None and max_active_dims < pooled.shape[1]:
        top = pooled.topk(max_active_dims, dim=1)
        pooled = torch.zeros_like(pooled).scatter_(1, top.indices, top.values)
    rows, cols = pooled.nonzero(as_tuple=True)  # row-major: each row's ids ascending
    values = pooled[rows, cols].cpu().numpy()
    counts = torch.bincount(rows, minlength=pooled.shape[0]).cpu().numpy()
    splits = np.cumsum(counts)[:-1]
    return [
        SparseVector(i, v)
        for i, v in zip(np.split(cols.cpu().numpy(), splits), np.split(values, splits), strict=True)
    ]


class SparseEmbedder(EmbedderInputs):
    """SPLADE vectors of texts: tokenize -> packed encoder -> masked-LM head -> pooling over
    each text's tokens (`splade_pool`) -> nonzero entries (`SparseVector`)."""

    def __init__(
        self,
        encoder: PackedBertEncoder,
        head: MaskedLMHead,
        tokenizer: TextTokenizer,
        layout: SparseLayout,
        truncate_default: bool,
        max_batch_tokens: int,
        max_batch_size: int,
    ):
        self.encoder, self.head, self.tokenizer, self.layout = encoder, head, tokenizer, layout
        self.truncate_default = truncate_default
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_seq_length = tokenizer.max_length

    @classmethod
    def from_config(
        cls, config: EmbeddingConfig, device: torch.device, base_dir: Path
    ) -> SparseEmbedder:
        """Load the checkpoint `config.model` as a SPLADE model (see `EmbeddingConfig`)."""
        require(
            config.normalize is None,
            "normalize",
            config.normalize,
            "does not apply to sparse embeddings (SPLADE vectors are never normalised)",
        )
        model_dir, arch, weights, encoder = load_encoder(config, device, base_dir)
        if weights is None or not isinstance(encoder, PackedBertEncoder):
            raise ConfigError(
                "mode",
                config.mode,
                f"sparse embeddings need a BERT-family *ForMaskedLM; {config.model} is a decoder",
            )
        layout = read_sparse_layout(model_dir, config.model)
        if layout.dimension not in (None, arch.vocab_size):
            raise ConfigError(
                "model",
                config.model,
                f"SpladePooling embedding_dimension {layout.dimension} is not the vocabulary "
                f"size {arch.vocab_size}",
            )
        tied = read_json(model_dir / "config.json", config.model).get("tie_word_embeddings", True)
        head = MaskedLMHead(weights, arch, encoder.word, tied)
        tokenizer = TextTokenizer(model_dir, config.max_text_bytes, layout.do_lower_case)
        length = settle_max_length(config, tokenizer, arch, layout.max_seq_length)
        settle_batch_tokens(config, length, device)
        return cls(
            encoder,
            head,
            tokenizer,
            layout,
            truncate_default=config.truncate,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
        )

    @property
    def vocab_size(self) -> int:
        return self.encoder.arch.vocab_size

    def embed(
        self, token_ids: Sequence[Sequence[int]]
    ) -> tuple[list[SparseVector], list[MicroBatch]]:
        """The SPLADE vector of each item, in input order, and what each micro-batch did."""
        lengths = [len(ids) for ids in token_ids]
        for i, length in enumerate(lengths):
            if not 0 < length <= self.max_seq_length:
                raise InputError(f"item {i} has {length} tokens; expected 1..{self.max_seq_length}")
        out = np.empty(len(token_ids), dtype=object)

        @torch.inference_mode()
        def compute(indices: list[int]) -> np.ndarray:
            tokens = pack([token_ids[i] for i in indices], self.encoder.device)
            pooled = splade_pool(self.encoder(tokens), tokens, self.head, self.layout)
            vectors = np.empty(len(indices), dtype=object)
            for j, vector in enumerate(to_sparse(pooled, self.layout.max_active_dims)):
                vectors[j] = vector  # one by one: numpy would unpack the tuples
            return vectors

        batches = run_micro_batches(
            lengths, self.max_batch_tokens, self.max_batch_size, compute, out
        )
        return list(out), batches

    def encode(
        self, texts: Sequence[str], truncate: bool | None = None, prompt_name: str | None = None
    ) -> list[SparseVector]:
        """Tokenize (with the prompt `prompt_name`, or the default one) and embed."""
        prompt = self.resolve_prompt(prompt_name)
        return self.embed(self.tokenize(texts, truncate, prompt))[0]


def pad_rows(vectors: Sequence[SparseVector]) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] int64 ids padded with SPARSE_PAD_INDEX (-1) and [N, K] float32 weights padded with
    0, K the most entries of a row (at least 1): the `indices` and `values` outputs of a request."""
    width = max([1, *(len(v.indices) for v in vectors)])
    indices = np.full((len(vectors), width), SPARSE_PAD_INDEX, dtype=np.int64)
    values = np.zeros((len(vectors), width), dtype=np.float32)
    for row, vector in enumerate(vectors):
        indices[row, : len(vector.indices)] = vector.indices
        values[row, : len(vector.values)] = vector.values
    return indices, values
