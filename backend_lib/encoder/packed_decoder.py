"""Decoder bodies (Llama, Mistral, Qwen2, Qwen3) as packed encoders: the LLM engine's own model
forward (backend_lib/llm/execution/models/llama.py) run over a micro-batch of whole texts.

Decoder embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral) and rerankers
(`*ForSequenceClassification`, Qwen3-Reranker converted) are these bodies under a pooling or a
score head. Each text is one sequence of a paged prefill: the batch is packed (no padding), the
attention is causal within each text, and nothing is kept after the forward. K/V go to a scratch
block pool of one layer, which every layer reuses: a layer reads back only what it wrote in the
same forward, so the next layer may overwrite it (the pool costs 1/num_layers of a full cache).
When only some rows are wanted (last-token pooling, a score head), the whole blocks of a token
prefix all texts of the micro-batch share (an instruction prompt; a reranker's template and query)
are computed once, as a sequence the others attend to.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from backend_lib.checkpoint import safetensors_files
from backend_lib.config import ConfigError
from backend_lib.encoder.packed_tokens import PackedTokens
from backend_lib.linear import pack_linear_layers
from backend_lib.llm.execution.attention import select_kernel_ops
from backend_lib.llm.execution.flat_batch import flat_batch
from backend_lib.llm.execution.kv_pool import KVCacheSpec, KVPool
from backend_lib.llm.execution.models import MODEL_REGISTRY
from backend_lib.llm.execution.models.llama import DEFAULT_MAX_POSITION_EMBEDDINGS

DECODER_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""config.json `model_type` of the decoder bodies served as encoders -> the engine's class."""
HEAD_TENSORS = ("lm_head.weight", "score.weight")
"""Heads stored beside the body; the body never loads them (`DecoderHeads` reads them)."""
BLOCK_SIZE = 16
"""Tokens per scratch KV block: also the granularity of a shared prefix (`shared_prefix`)."""


def is_decoder(model_dir: Path) -> bool:
    """Whether config.json's `model_type` is one of the decoder bodies."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return config.get("model_type") in DECODER_MODEL_TYPES


@dataclass(frozen=True)
class DecoderArchitecture:
    """The fields of config.json a decoder encoder needs (the encoders' `arch` interface)."""

    model_type: str
    architecture: str  # config.json architectures[0], e.g. "Qwen3Model"
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    pad_token_id: int | None
    num_labels: int
    family: str = "decoder"

    @property
    def max_tokens(self) -> int:
        """Longest sequence the model admits (rotary positions: its trained length)."""
        return self.max_position_embeddings

    @classmethod
    def read(cls, model_dir: Path, spec: str) -> DecoderArchitecture:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        model_type = config.get("model_type", "")
        if model_type not in DECODER_MODEL_TYPES:
            raise ConfigError(
                "model",
                spec,
                f"model_type '{model_type}' is not a supported decoder; expected one of "
                f"{', '.join(DECODER_MODEL_TYPES)}",
            )
        try:
            return cls(
                model_type=model_type,
                architecture=(config.get("architectures") or [""])[0],
                hidden_size=config["hidden_size"],
                vocab_size=config["vocab_size"],
                max_position_embeddings=config.get(
                    "max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS
                ),
                pad_token_id=config.get("pad_token_id"),
                num_labels=len(config.get("id2label") or {}) or config.get("num_labels", 2),
            )
        except KeyError as missing:
            raise ConfigError("model", spec, f"config.json lacks {missing}") from None


def _body_tensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The body's tensors under the causal-LM names the engine's model loads: a bare `Qwen3Model`
    save ("layers.0...") gains the "model." prefix; heads are left out."""
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if name in HEAD_TENSORS:
                    continue
                key = name if name.startswith("model.") else f"model.{name}"
                yield key, handle.get_tensor(name)


class PackedDecoderEncoder:
    """Token ids in, final-normed hidden states out, both packed: [T] -> [T, hidden_size]."""

    concurrent_forwards = False
    """Forwards share one KV pool between calls: one at a time (no priority lane)."""

    def __init__(
        self,
        model_dir: Path,
        arch: DecoderArchitecture,
        dtype: torch.dtype,
        device: torch.device,
        spec: str,
    ):
        self.arch, self.dtype, self._device = arch, dtype, device
        self.ops = select_kernel_ops("auto", device)
        self.model = self._load(model_dir, spec)
        args = self.model.args
        self.num_layers = args.num_layers
        self.kv_spec = KVCacheSpec(1, args.num_kv_heads, args.head_dim, BLOCK_SIZE, dtype)
        self._pool: KVPool | None = None

    def _load(self, model_dir: Path, spec: str) -> torch.nn.Module:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        model_class = MODEL_REGISTRY[DECODER_MODEL_TYPES[self.arch.model_type]]
        try:
            # Tied: the (unused) lm_head shares the embedding instead of needing a tensor.
            args = replace(model_class.args_from_config(config), tie_word_embeddings=True)
        except (KeyError, ValueError) as e:
            raise ConfigError("model", spec, f"bad config.json: {e}") from e
        with torch.device("meta"):
            model = model_class(args, self.ops, self._device, args.max_position_embeddings)
        model = model.to(self.dtype).to_empty(device=self._device)
        model.tie_weights()
        try:
            model.load_weights(_body_tensors(safetensors_files(model_dir, spec), self._device))
        except ValueError as e:
            raise ConfigError("model", spec, str(e)) from e
        pack_linear_layers(model)
        model.bind_forward()
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self._device

    def _layer_caches(self, num_blocks: int) -> list:
        """One scratch layer cache of at least `num_blocks` blocks, handed to every layer."""
        if self._pool is None or self._pool.num_blocks < num_blocks:
            self._pool = None  # free the old pool before the bigger one is allocated
            self._pool = KVPool(self.kv_spec, num_blocks, 0, self._device)
        return [self._pool.layer_caches[0]] * self.num_layers

    def __call__(
        self, tokens: PackedTokens, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden_size] states of every token, or only those of `output_rows` ([R] int64
        rows of `tokens`). With `output_rows`, a token prefix every sequence shares (an
        instruction prompt, a reranker's query) is computed once (`shared_prefix`)."""
        ids = (tokens.host_ids if tokens.host_ids is not None else tokens.input_ids.cpu()).numpy()
        lengths = np.array(tokens.lengths, dtype=np.int64)
        shared = 0
        # A prefix shares whole blocks and leaves each sequence a token of its own.
        if output_rows is not None and len(lengths) > 1 and lengths.min() > BLOCK_SIZE:
            owner = torch.searchsorted(tokens.starts, output_rows, right=True) - 1
            offsets = output_rows - tokens.starts[owner]
            # Rows inside the prefix would not be computed: it ends at or before the first.
            limit = min(int(offsets.min()), int(lengths.min()) - 1)
            shared = shared_prefix(ids, lengths, limit)
        if shared:
            batch, caches = self._shared_batch(ids, lengths, shared)
            output_rows = self._rows_after_prefix(tokens, owner, offsets, shared)
        else:
            batch, caches = self._batch(ids, lengths)
        meta = batch.meta
        if self.ops.plan_attention is not None:
            meta.plan = self.ops.plan_attention(
                meta.query_start_loc, meta.seq_lens, meta.block_tables, caches[0][0]
            )
        return self.model(batch.input_ids, batch.positions, meta, caches, None, output_rows)

    def _batch(self, ids: np.ndarray, lengths: np.ndarray):
        """Each sequence a whole prefill in blocks of its own."""
        blocks = -(-lengths // BLOCK_SIZE)
        first = np.concatenate(([0], np.cumsum(blocks)))
        tables = [list(range(first[b], first[b + 1])) for b in range(len(lengths))]
        caches = self._layer_caches(int(first[-1]))
        zeros = np.zeros_like(lengths)
        return flat_batch(ids, zeros, lengths, tables, [], BLOCK_SIZE, self._device), caches

    def _shared_batch(self, ids: np.ndarray, lengths: np.ndarray, shared: int):
        """The shared prefix as a sequence of its own (first, so its K/V are in its blocks when
        the others attend: each layer writes every row's K/V before attending), then each
        sequence's rest, its table starting with the prefix's blocks."""
        prefix_blocks = shared // BLOCK_SIZE
        rest = lengths - shared
        own = -(-lengths // BLOCK_SIZE) - prefix_blocks
        first = np.concatenate(([prefix_blocks], prefix_blocks + np.cumsum(own)))
        prefix = list(range(prefix_blocks))
        tables = [prefix] + [prefix + list(range(first[b], first[b + 1])) for b in range(len(rest))]
        caches = self._layer_caches(int(first[-1]))
        starts = np.concatenate(([0], np.full(len(rest), shared)))
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        keep = np.concatenate(
            [ids[o + shared : o + n] for o, n in zip(offsets, lengths, strict=True)]
        )
        flat = np.concatenate((ids[:shared], keep))
        q_lens = np.concatenate(([shared], rest))
        return flat_batch(flat, starts, q_lens, tables, [], BLOCK_SIZE, self._device), caches

    @staticmethod
    def _rows_after_prefix(
        tokens: PackedTokens, owner: torch.Tensor, offsets: torch.Tensor, shared: int
    ) -> torch.Tensor:
        """Rows at `offsets` ([R] int64) in their sequences `owner` ([R] int64) as rows of the
        shared-prefix batch: the prefix first, then each sequence's rest."""
        sequence = torch.arange(len(tokens.lengths), device=owner.device)
        rest_starts = shared + tokens.starts - shared * sequence
        return rest_starts[owner] + offsets - shared


def shared_prefix(ids: np.ndarray, lengths: np.ndarray, limit: int) -> int:
    """Tokens every packed sequence of `ids` starts with, at most `limit`, in whole scratch blocks
    (the prefix's K/V blocks are shared; a partial block would be each sequence's own); 0 when
    that is less than one block."""
    limit = (min(limit, int(lengths.min())) // BLOCK_SIZE) * BLOCK_SIZE
    if limit <= 0:
        return 0
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    head = ids[:limit]
    common = limit
    for offset in offsets[1:]:
        differ = np.flatnonzero(ids[offset : offset + common] != head[:common])
        if len(differ):
            common = int(differ[0])
            if common < BLOCK_SIZE:
                return 0
    return (common // BLOCK_SIZE) * BLOCK_SIZE


def read_head(
    model_dir: Path, name: str, dtype: torch.dtype, device: torch.device, spec: str
) -> torch.Tensor | None:
    """Head tensor `name` ("score.weight", "lm_head.weight") of the checkpoint, None if absent."""
    for path in safetensors_files(model_dir, spec):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118
                return handle.get_tensor(name).to(device=device, dtype=dtype)
    return None


def read_head_rows(model_dir: Path, name: str, rows: list[int], spec: str) -> torch.Tensor | None:
    """Rows `rows` of head tensor `name`, float32 [len(rows), hidden]; None if the checkpoint lacks
    it. Only those rows are read."""
    for path in safetensors_files(model_dir, spec):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118
                tensor = handle.get_slice(name)
                return torch.cat([tensor[r : r + 1] for r in rows]).float()
    return None


class LastTokenScoreHead:
    """A decoder `*ForSequenceClassification` head: `score` ([num_labels, hidden], no bias) on
    each sequence's last token, picked as transformers picks it: the rightmost token that is not
    config.json's `pad_token_id` (the first token when all are)."""

    def __init__(self, weight: torch.Tensor, pad_token_id: int | None):
        self.weight, self.pad_token_id = weight, pad_token_id

    @classmethod
    def read(
        cls, model_dir: Path, arch: DecoderArchitecture, encoder: PackedDecoderEncoder, spec: str
    ) -> LastTokenScoreHead:
        weight = read_head(model_dir, "score.weight", encoder.dtype, encoder.device, spec)
        if weight is None:
            raise ConfigError("model", spec, "a decoder reranker needs its 'score.weight' head")
        return cls(weight, arch.pad_token_id)

    @classmethod
    def from_token_logits(
        cls,
        model_dir: Path,
        encoder: PackedDecoderEncoder,
        true_token_id: int,
        false_token_id: int | None,
        spec: str,
    ) -> LastTokenScoreHead:
        """A causal LM's token-logit score as a one-label head: lm_head[true] - lm_head[false]
        (lm_head[true] alone without a false token), on the last token (sentence-transformers'
        LogitScore, vLLM's `classifier_from_token`). One [1, hidden] row replaces the
        [vocab, hidden] lm_head: the logits of the other tokens are never computed."""
        ids = [true_token_id] + ([] if false_token_id is None else [false_token_id])
        bad = [i for i in ids if not 0 <= i < encoder.arch.vocab_size]
        if bad:
            raise ConfigError(
                "classifier_from_token",
                spec,
                f"token ids {bad} are outside the vocabulary [0, {encoder.arch.vocab_size})",
            )
        rows = read_head_rows(model_dir, "lm_head.weight", ids, spec)
        if rows is None:  # tied: the embedding is the lm_head
            rows = encoder.model.model.embed_tokens.weight[ids].float()
        weight = rows[:1] - rows[1:2] if false_token_id is not None else rows[:1]
        # The last token as the causal model saw it, whatever it is (no pad-token search).
        return cls(weight.to(encoder.dtype), None)

    def rows(self, tokens: PackedTokens) -> torch.Tensor:
        """[B] int64: the packed row each sequence is scored on."""
        ids = tokens.input_ids
        if self.pad_token_id is None:
            return tokens.starts + tokens.lengths_t - 1
        # Running max of the non-pad rows' own indices: at each sequence's end, its last one.
        rows = torch.arange(tokens.num_tokens, device=ids.device)
        first = torch.repeat_interleave(tokens.starts, tokens.lengths_t, output_size=len(rows))
        marked = torch.where(ids.ne(self.pad_token_id), rows, first)
        return torch.cummax(marked, 0).values[tokens.starts + tokens.lengths_t - 1]

    def __call__(self, encoder: PackedDecoderEncoder, tokens: PackedTokens) -> torch.Tensor:
        """[B, num_labels] logits."""
        return encoder(tokens, self.rows(tokens)) @ self.weight.T
