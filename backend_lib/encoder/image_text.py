"""Text and image embeddings in one space, from CLIP and SigLIP checkpoints (transformers'
`CLIPModel`, `SiglipModel`), served by the embedding model.

The checkpoint's two towers run as transformers implements them (loaded offline from safetensors,
SDPA attention): `get_text_features` on a micro-batch of texts, `get_image_features` on one of
images; a micro-batch never mixes the two. Texts are tokenized as the checkpoint's processor does:
CLIP's unpadded and cut at the text tower's positions (77), SigLIP's padded to its positions (64),
as it was trained, and without an attention mask where its tokenizer gives none. An image is
decoded within the model's limits (`backend_lib.multimodal.images`) and preprocessed by the
checkpoint's own image processor (preprocessor_config.json, transformers' PIL backend) when its
request arrives, so only [3, H, W] pixel tensors wait in the scheduler's queue and a bad image
fails its request alone. An image costs the scheduler its vision tower's token count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    # Imported on load, not at start (docs/architecture.md, import rules).
    from transformers import BaseImageProcessor, PretrainedConfig, PreTrainedModel

from backend_lib.checkpoint import HF_OFFLINE_KWARGS, resolve_model_path
from backend_lib.config import ConfigError, require
from backend_lib.device import resolve_dtype
from backend_lib.encoder.batching import MicroBatch
from backend_lib.encoder.config import EmbeddingConfig
from backend_lib.encoder.embedder import (
    EmbedderInputs,
    VectorSizes,
    embed_in_micro_batches,
    settle_batch_tokens,
)
from backend_lib.encoder.st_config import read_json
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.multimodal.images import ImageLimits, decode_image
from backend_lib.multimodal.resize import check_processor_fits, check_resized


@dataclass(frozen=True)
class ImageTextFamily:
    """What differs between the image-text architectures served."""

    pad_texts: bool
    """Every text is padded to the text tower's positions (SigLIP was trained so)."""
    class_token: bool
    """The vision tower puts a class token before its patches (CLIP)."""
    projection: Callable[[PretrainedConfig], int]
    """The shared space's size (the vectors' `dim`) from the checkpoint's config."""


FAMILIES: dict[str, ImageTextFamily] = {
    "CLIPModel": ImageTextFamily(False, True, lambda config: config.projection_dim),
    "SiglipModel": ImageTextFamily(True, False, lambda config: config.text_config.projection_size),
}
"""The image-text architectures served, by config.json's `architectures` name."""


def image_text_architecture(model_dir: Path, spec: str) -> str | None:
    """The checkpoint's architecture when it is one of FAMILIES', else None."""
    architectures = read_json(model_dir / "config.json", spec).get("architectures") or []
    return architectures[0] if architectures and architectures[0] in FAMILIES else None


def serves_image_text(config: EmbeddingConfig, base_dir: Path) -> bool:
    """Whether `config`'s checkpoint is an image-text one (`ImageTextEmbedder` serves it)."""
    model_dir = resolve_model_path(config.model, base_dir)
    return image_text_architecture(model_dir, config.model) is not None


@dataclass(frozen=True)
class NoPrompts:
    """The prompts of a checkpoint without sentence-transformers prompts (`PromptLayout`)."""

    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


class ImageTextEmbedder(EmbedderInputs, VectorSizes):
    """Embeds texts (`tokenize` or `check_token_ids`, then `embed`) and images
    (`preprocess_image`, then `embed_images`) of a CLIP or SigLIP checkpoint into its shared
    space: [N, dim] float32 rows, unit length unless asked otherwise."""

    layout = NoPrompts()

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: TextTokenizer,
        image_processor: BaseImageProcessor,
        family: ImageTextFamily,
        limits: ImageLimits,
        *,
        normalize_default: bool = True,
        truncate_default: bool = True,
        max_batch_tokens: int,
        max_batch_size: int,
    ):
        """`model`: the checkpoint's CLIPModel or SiglipModel, eval mode; `image_processor`: its
        image processor (PIL backend); `tokenizer.max_length`: the tokens a text is cut to (at
        most the text positions); `limits`: what one encoded image may be."""
        self.model, self.tokenizer, self.image_processor = model, tokenizer, image_processor
        self.family, self.limits = family, limits
        self.normalize_default, self.truncate_default = normalize_default, truncate_default
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_seq_length = tokenizer.max_length
        """Tokens per text, special tokens included (texts are cut there)."""
        self.dim = family.projection(model.config)
        """The shared space's size: every vector's length."""
        self.dimensions = (self.dim,)
        self.image_tokens = vision_tokens(model.config, family)
        """The vision tower's tokens per image: what an image costs the scheduler."""
        self.text_positions = int(model.config.text_config.max_position_embeddings)
        """The text tower's positions: SigLIP pads every text to this many tokens."""
        hf_tokenizer = tokenizer.tokenizer
        pad = hf_tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else hf_tokenizer.eos_token_id or 0)
        self._text_mask = "attention_mask" in hf_tokenizer.model_input_names
        check_processor_fits(image_processor, limits)

    @classmethod
    def from_config(
        cls, config: EmbeddingConfig, device: torch.device, base_dir: Path
    ) -> ImageTextEmbedder:
        """Load the CLIP or SigLIP checkpoint `config.model`: its model in the configured dtype,
        its tokenizer and its image processor (preprocessor_config.json)."""
        model_dir = resolve_model_path(config.model, base_dir)
        architecture = image_text_architecture(model_dir, config.model)
        if architecture is None:
            raise ConfigError(
                "model", config.model, f"its architecture is not one of {', '.join(FAMILIES)}"
            )
        require(
            config.mode != "sparse",
            "mode",
            config.mode,
            f"a {architecture} checkpoint serves dense vectors only",
        )
        model = _load_model(model_dir, resolve_dtype(config.dtype, device), device)
        tokenizer = TextTokenizer(model_dir, config.max_text_bytes)
        positions = int(model.config.text_config.max_position_embeddings)
        tokenizer.max_length = _text_length(config.max_seq_length, positions)
        family = FAMILIES[architecture]
        longest_text = positions if family.pad_texts else tokenizer.max_length
        longest = max(longest_text, vision_tokens(model.config, family))
        return cls(
            model,
            tokenizer,
            _load_image_processor(model_dir, config.model),
            family,
            config.image_limits,
            normalize_default=True if config.normalize is None else config.normalize,
            truncate_default=config.truncate,
            max_batch_tokens=settle_batch_tokens(config, longest, device),
            max_batch_size=config.max_batch_size,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.text_config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- texts ---------------------------------------------------------------------------------

    def tokenize(
        self, texts: Sequence[str], truncate: bool | None = None, prompt: str | None = None
    ) -> list[list[int]]:
        """Token ids per text as the checkpoint's processor makes them (SigLIP: padded)."""
        return self._padded(super().tokenize(texts, truncate, prompt))

    def check_token_ids(self, items: Sequence[Sequence[int]]) -> list[list[int]]:
        """Token-id items as sent (`EmbedderInputs.check_token_ids`), padded as texts are."""
        return self._padded(super().check_token_ids(items))

    def pool_skip(self, prompt: str | None) -> int:
        """No prompt tokens are ever left out: the text tower pools one token itself."""
        return 0

    def embed(
        self,
        token_ids: Sequence[Sequence[int]],
        normalize: bool | None = None,
        skip: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N, dim] float32 text vectors (`get_text_features`) in input order, and what each
        micro-batch did; `skip` is accepted for `Embedder.embed`'s callers and must be zeros."""
        if skip is not None and any(skip):
            raise ValueError("an image-text checkpoint pools no prompt: skip must be zeros")
        rows = [list(ids) for ids in token_ids]
        return self._run(
            [len(ids) for ids in rows],
            lambda indices: self._text_features([rows[i] for i in indices]),
            normalize,
        )

    def _padded(self, items: list[list[int]]) -> list[list[int]]:
        if not self.family.pad_texts:
            return items
        return [ids + [self._pad_id] * (self.text_positions - len(ids)) for ids in items]

    def _text_features(self, rows: list[list[int]]) -> torch.Tensor:
        """[len(rows), dim] from right-padded ids [len(rows), longest] (masked where the
        tokenizer gives a mask)."""
        longest = max(len(ids) for ids in rows)
        ids = torch.full((len(rows), longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        extra = {"attention_mask": mask.to(self.device)} if self._text_mask else {}
        return self.model.get_text_features(input_ids=ids.to(self.device), **extra).pooler_output

    # --- images --------------------------------------------------------------------------------

    def preprocess_image(self, data: bytes) -> torch.Tensor:
        """One encoded image (PNG, JPEG, WebP) -> its [3, H, W] float32 pixel values, as the
        checkpoint's image processor makes them. `InputError` for a bad or oversized image."""
        decoded = decode_image(data, self.limits)
        check_resized(self.image_processor, *decoded.size, self.limits)
        pixels = self.image_processor(images=[decoded.image], return_tensors="pt")
        return pixels["pixel_values"][0]

    def embed_images(
        self, pixels: Sequence[torch.Tensor], normalize: bool | None = None
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """[N, dim] float32 image vectors (`get_image_features`) of `preprocess_image` outputs,
        in input order, and what each micro-batch did."""
        return self._run(
            [self.image_tokens] * len(pixels),
            lambda indices: self._image_features([pixels[i] for i in indices]),
            normalize,
        )

    def _image_features(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.stack(pixels).to(device=self.device, dtype=self.model.dtype)
        return self.model.get_image_features(pixel_values=batch).pooler_output

    # --- both ----------------------------------------------------------------------------------

    def _run(
        self,
        lengths: list[int],
        features: Callable[[list[int]], torch.Tensor],
        normalize: bool | None,
    ) -> tuple[np.ndarray, list[MicroBatch]]:
        """`features(indices)` of each micro-batch of items of `lengths` tokens, L2-normalised
        when `normalize` (None: the default) says."""
        unit = self.normalize_default if normalize is None else normalize
        budget = (self.max_batch_tokens, self.max_batch_size)
        return embed_in_micro_batches(lengths, budget, self.dim, features, unit)


def vision_tokens(config: PretrainedConfig, family: ImageTextFamily) -> int:
    """The vision tower's tokens per image: (image_size / patch_size)^2 patches, plus CLIP's
    class token."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + int(family.class_token)


def _text_length(max_seq_length: int, positions: int) -> int:
    """The tokens a text is cut to: the configured `max_seq_length`, else the text tower's
    `positions` (the processor's truncation)."""
    length = max_seq_length or positions
    require(
        length <= positions,
        "max_seq_length",
        length,
        f"the checkpoint's text position embeddings hold at most {positions} tokens",
    )
    return length


def _load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """The transformers model, from safetensors only, with SDPA attention, in eval mode."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(
        str(model_dir),
        dtype=dtype,
        attn_implementation="sdpa",
        use_safetensors=True,
        **HF_OFFLINE_KWARGS,
    )
    return model.to(device).eval()


def _load_image_processor(model_dir: Path, spec: str) -> BaseImageProcessor:
    """The checkpoint's image processor from preprocessor_config.json, PIL backend (the
    torchvision one is not installed); ConfigError when the file is missing or unreadable."""
    from transformers import AutoImageProcessor

    if not (model_dir / "preprocessor_config.json").is_file():
        raise ConfigError(
            "model", spec, "no preprocessor_config.json: an image-text checkpoint needs one"
        )
    try:
        return AutoImageProcessor.from_pretrained(
            str(model_dir), backend="pil", **HF_OFFLINE_KWARGS
        )
    except (OSError, ValueError) as exc:
        raise ConfigError("model", spec, f"cannot load its image processor: {exc}") from None
