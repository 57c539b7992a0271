"""Random-weight vision checkpoints for tests, saved to a dir the way their hub originals are laid
out, built offline with transformers (nothing is downloaded).

- `build_clip`: a tiny `CLIPModel` with a byte-level BPE `CLIPTokenizer` (tokenizer.json from a
  small vocabulary and merges, CLIP's lower-casing and `</w>` word ends) and a
  `CLIPImageProcessor` preprocessor_config.json (short side resize, center crop, CLIP's mean/std).
- `build_siglip`: a tiny `SiglipModel` with a SigLIP-style tokenizer (SiglipTokenizer needs
  sentencepiece, which is not installed: a `tokenizers` Unigram tokenizer.json doing what it does
  instead: lower-case, punctuation removed, `</s>` appended, `</s>` as padding, input_ids only)
  and a `SiglipImageProcessor` preprocessor_config.json (resize to a square, mean/std 0.5).

transformers' `AutoProcessor` loads both directories (CLIPProcessor, SiglipProcessor), so tests
compare against the checkpoint's own processor and model. Every weight is redrawn
(`tooling.checkpoints.randomize_`), so the vectors differ visibly between inputs.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import torch
import transformers

from tooling.checkpoints import randomize_

_WORD_LIST = """
a photo of the cat dog red blue green sky sea rose king queen
storm at night sweet smells picture painting
"""
WORDS = tuple(_WORD_LIST.split())
"""Whole-word tokens of both tokenizers (other words fall back to letters or bytes)."""

TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
"""Both towers' shape, text and vision."""
IMAGE_SIZE, PATCH_SIZE = 32, 8
"""The vision towers' input side and patch side, pixels: 16 patches."""
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_clip(
    out_dir: Path,
    seed: int = 0,
    vision: dict[str, int] | None = None,
    image_size: int = IMAGE_SIZE,
    patch_size: int = PATCH_SIZE,
) -> Path:
    """A random CLIPModel (projection 16, 77 text positions, 32-pixel images: 16 patches and a
    class token) with its tokenizer and image processor, saved to `out_dir`; returns it.
    `vision`, `image_size`, `patch_size`: a larger vision tower (the benchmarks'), whose weights
    keep transformers' initialisation."""
    out_dir = Path(out_dir)
    tokenizer = _clip_tokenizer()
    tokenizer.save_pretrained(out_dir)
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = transformers.CLIPConfig(
        text_config=dict(TOWER, vocab_size=len(tokenizer), max_position_embeddings=77, **special),
        vision_config=dict(vision or TOWER, image_size=image_size, patch_size=patch_size),
        projection_dim=16,
    )
    _save_model(transformers.CLIPModel, config, out_dir, seed, randomize=vision is None)
    _write_json(
        out_dir / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "CLIPProcessor",
            "do_resize": True,
            "size": {"shortest_edge": image_size},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    return out_dir


def build_siglip(out_dir: Path, seed: int = 0) -> Path:
    """A random SiglipModel (32-wide space, 64 text positions, 32-pixel images: 16 patches,
    attention-pooled) with its tokenizer and image processor, saved to `out_dir`; returns it."""
    out_dir = Path(out_dir)
    tokenizer = _siglip_tokenizer()
    tokenizer.save_pretrained(out_dir)
    config = transformers.SiglipConfig(
        text_config=dict(
            TOWER,
            vocab_size=len(tokenizer),
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(TOWER, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),
    )
    _save_model(transformers.SiglipModel, config, out_dir, seed)
    _write_json(
        out_dir / "preprocessor_config.json",
        {
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "SiglipProcessor",
            "do_resize": True,
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    )
    return out_dir


def _save_model(cls: type, config: Any, out_dir: Path, seed: int, randomize: bool = True) -> None:
    torch.manual_seed(seed)
    model = cls(config)
    if randomize:
        randomize_(model, seed)
    model.save_pretrained(out_dir)


def _clip_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """CLIP's byte-level BPE over the 256 byte symbols (each also as a word end, `</w>`), merges
    spelling out WORDS left to right, then <|startoftext|> and <|endoftext|> last (as in CLIP's
    vocabulary, where the end token has the highest id)."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for token in symbols + [symbol + "</w>" for symbol in symbols]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        pieces = [*word[:-1], word[-1] + "</w>"]
        left = pieces[0]
        for piece in pieces[1:]:
            if (left, piece) not in merges:
                merges.append((left, piece))
            left += piece
            vocab.setdefault(left, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _siglip_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A Unigram tokenizer as SiglipTokenizer tokenizes: lower-cased, punctuation dropped,
    whitespace collapsed, "▁"-prefixed pieces (WORDS whole, else letters and digits), `</s>`
    appended; `</s>` pads (id 1), and only input_ids are returned (no attention mask)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_lowercase + string.digits]
    pieces += [("▁" + c, -3.5) for c in string.ascii_lowercase + string.digits]
    pieces += [("▁" + word, -1.0) for word in WORDS]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    punctuation = "[" + "".join("\\" + c for c in string.punctuation) + "]"
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.Lowercase(),
            normalizers.Replace(Regex(punctuation), ""),
            normalizers.Replace(Regex(r"\s+"), " "),
            normalizers.Strip(),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="</s>",
        pad_token="</s>",
        unk_token="<unk>",
        model_max_length=64,
        model_input_names=["input_ids"],
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
