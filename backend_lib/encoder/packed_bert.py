"""BERT / RoBERTa / XLM-RoBERTa encoder that runs on packed (unpadded) tokens.

Linear layers and LayerNorms work on [total_tokens, hidden]; attention keeps sequences
apart (`backend_lib.encoder.attention`). It computes what the Hugging Face models compute
for unpadded inputs, reading their safetensors weights directly:

- BERT: positions 0..L-1, token-type embeddings from the tokenizer's type ids.
- RoBERTa family: positions start at pad_token_id + 1 and skip pad tokens
  (transformers' `create_position_ids_from_input_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from backend_lib.config import ConfigError
from backend_lib.encoder.attention import PaddedAttention, RunAttention
from backend_lib.encoder.packed_tokens import PackedTokens
from backend_lib.encoder.weights import CheckpointWeights
from backend_lib.linear import Linear

_FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "camembert": "roberta"}
_DEFAULT_PAD = {"bert": 0, "roberta": 1}
_HIDDEN_ACTS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
Attention = RunAttention | PaddedAttention


@dataclass(frozen=True)
class EncoderArchitecture:
    """The fields of config.json the encoder needs."""

    family: str  # "bert" or "roberta"
    architecture: str  # config.json architectures[0], e.g. "BertModel"
    hidden_size: int
    num_heads: int
    num_layers: int
    layer_norm_eps: float
    hidden_act: str  # key of backend_lib.linear._ACTIVATIONS
    max_position_embeddings: int
    type_vocab_size: int
    vocab_size: int
    pad_token_id: int
    num_labels: int

    @property
    def position_offset(self) -> int:
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """Longest sequence the position table can hold."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def read(cls, model_dir: Path, spec: str) -> EncoderArchitecture:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        model_type = config.get("model_type", "")
        if model_type not in _FAMILIES:
            raise ConfigError(
                "model",
                spec,
                f"model_type '{model_type}' is not supported; expected one of {', '.join(_FAMILIES)}",
            )
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("model", spec, "only absolute position embeddings are supported")
        act = config.get("hidden_act", "gelu")
        if act not in _HIDDEN_ACTS:
            raise ConfigError("model", spec, f"hidden_act '{act}' is not supported")
        architectures = config.get("architectures") or [""]
        family = _FAMILIES[model_type]
        try:
            return cls(
                family=family,
                architecture=architectures[0],
                hidden_size=config["hidden_size"],
                num_heads=config["num_attention_heads"],
                num_layers=config["num_hidden_layers"],
                layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                hidden_act=_HIDDEN_ACTS[act],
                max_position_embeddings=config["max_position_embeddings"],
                type_vocab_size=config.get("type_vocab_size", 2),
                vocab_size=config["vocab_size"],
                # transformers' defaults when config.json omits it: BERT 0, RoBERTa family 1.
                pad_token_id=config.get("pad_token_id")
                if config.get("pad_token_id") is not None
                else _DEFAULT_PAD[family],
                num_labels=len(config.get("id2label") or {}) or config.get("num_labels", 2),
            )
        except KeyError as missing:
            raise ConfigError("model", spec, f"config.json lacks {missing}") from None


@dataclass
class _LayerNorm:
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _Layer:
    """One transformer block (post-LayerNorm, as in BERT)."""

    def __init__(self, w: CheckpointWeights, index: int, arch: EncoderArchitecture):
        p = f"encoder.layer.{index}."
        q, k, v = (f"{p}attention.self.{n}" for n in ("query", "key", "value"))
        # One [3H, H] projection instead of three: fewer, larger GEMMs.
        self.qkv = Linear(
            torch.cat([w.get(f"{q}.weight"), w.get(f"{k}.weight"), w.get(f"{v}.weight")]),
            torch.cat([w.get(f"{q}.bias"), w.get(f"{k}.bias"), w.get(f"{v}.bias")]),
        )
        self.attn_out = Linear(
            w.get(f"{p}attention.output.dense.weight"), w.get(f"{p}attention.output.dense.bias")
        )
        self.attn_norm = _LayerNorm(
            w.get(f"{p}attention.output.LayerNorm.weight"),
            w.get(f"{p}attention.output.LayerNorm.bias"),
            arch.layer_norm_eps,
        )
        self.up = Linear(
            w.get(f"{p}intermediate.dense.weight"),
            w.get(f"{p}intermediate.dense.bias"),
            arch.hidden_act,
        )
        self.down = Linear(w.get(f"{p}output.dense.weight"), w.get(f"{p}output.dense.bias"))
        self.out_norm = _LayerNorm(
            w.get(f"{p}output.LayerNorm.weight"),
            w.get(f"{p}output.LayerNorm.bias"),
            arch.layer_norm_eps,
        )
        self.heads = arch.num_heads

    def __call__(self, x: torch.Tensor, attention: Attention, plan: Any) -> torch.Tensor:
        context = attention(self.qkv(x), plan, self.heads)
        x = self.attn_norm(self.attn_out(context, residual=x))
        return self.out_norm(self.down(self.up(x), residual=x))


class PackedBertEncoder:
    """Token ids in, final hidden states out, both packed: [T] -> [T, hidden].

    `attention` is `RunAttention` on CPU and `PaddedAttention` elsewhere unless given
    (see `backend_lib.encoder.attention`).
    """

    concurrent_forwards = True
    """Forwards keep no state between calls, so two may run at once (the priority lane)."""

    def __init__(
        self,
        weights: CheckpointWeights,
        arch: EncoderArchitecture,
        attention: Attention | None = None,
    ):
        self.arch = arch
        if attention is None:
            attention = RunAttention() if weights.device.type == "cpu" else PaddedAttention()
        self.attention = attention
        self.word = weights.get("embeddings.word_embeddings.weight")
        self.position = weights.get("embeddings.position_embeddings.weight")
        self.token_type = weights.get("embeddings.token_type_embeddings.weight")
        self.embed_norm = _LayerNorm(
            weights.get("embeddings.LayerNorm.weight"),
            weights.get("embeddings.LayerNorm.bias"),
            arch.layer_norm_eps,
        )
        self.layers = [_Layer(weights, i, arch) for i in range(arch.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.word.device

    def __call__(self, tokens: PackedTokens) -> torch.Tensor:
        x = self._embed(tokens)
        plan = self.attention.prepare(tokens)
        for layer in self.layers:
            x = layer(x, self.attention, plan)
        return x

    def _embed(self, tokens: PackedTokens) -> torch.Tensor:
        ids = tokens.input_ids
        x = F.embedding(ids, self.word)
        # Same summation order as transformers: word + token type + position.
        if tokens.token_type_ids is None or self.arch.type_vocab_size == 1:
            x = x + self.token_type[0]
        else:
            x = x + F.embedding(tokens.token_type_ids, self.token_type)
        x = x + F.embedding(self._positions(tokens), self.position)
        return self.embed_norm(x)

    def _positions(self, tokens: PackedTokens) -> torch.Tensor:
        if self.arch.family == "bert":
            return tokens.offsets_in_sequence()
        # RoBERTa: count non-pad tokens inside each sequence; pad tokens sit at padding_idx.
        not_pad = tokens.input_ids.ne(self.arch.pad_token_id).long()
        running = torch.cumsum(not_pad, 0)
        before_sequence = (running - not_pad)[tokens.starts]
        within = running - torch.repeat_interleave(
            before_sequence, tokens.lengths_t, output_size=tokens.num_tokens
        )
        return within * not_pad + self.arch.pad_token_id


class ClassifierHead:
    """Sequence-classification head on the first token: linear -> tanh -> linear.

    Covers BERT (`bert.pooler.dense` + `classifier`) and RoBERTa/XLM-R
    (`classifier.dense` + `classifier.out_proj`), which share this shape.
    """

    _NAMES = {
        "bert": ("{base}pooler.dense", "classifier"),
        "roberta": ("classifier.dense", "classifier.out_proj"),
    }

    def __init__(self, weights: CheckpointWeights, arch: EncoderArchitecture):
        dense, out = self._NAMES[arch.family]
        dense = dense.format(base=weights.prefix)
        self.dense = Linear(
            weights.get(f"{dense}.weight", False), weights.get(f"{dense}.bias", False), "tanh"
        )
        self.out = Linear(weights.get(f"{out}.weight", False), weights.get(f"{out}.bias", False))

    def __call__(self, encoder: PackedBertEncoder, tokens: PackedTokens) -> torch.Tensor:
        """[B, num_labels] logits of `encoder` on `tokens`."""
        return self.out(self.dense(encoder(tokens)[tokens.starts]))
