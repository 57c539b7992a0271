"""Encoder test fixtures: sentence-transformers' all-MiniLM-L6-v2 and our Embedder on it, a tiny
random-weight BERT written with `save_pretrained`, `enc`, which hands tests encoder_helpers.py, and
random CLIP and SigLIP checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.encoder.encoder_helpers import TEXTS, build_xlmr_tokenizer, write_json, write_st_files
from tooling.checkpoints import MINILM_DIR, MINILM_SPEC, copy_minilm_tokenizer, tiny_bert_config

torch.set_num_threads(2)


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

    return Embedder.from_config(EmbeddingConfig(dtype="float32"), torch.device("cpu"), Path("."))


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A random 2-layer BertModel with the MiniLM tokenizer (no sentence-transformers files)."""
    from transformers import BertModel

    torch.manual_seed(0)
    target = tmp_path_factory.mktemp("tiny_bert")
    BertModel(tiny_bert_config()).save_pretrained(target)
    copy_minilm_tokenizer(target)
    return target


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


@pytest.fixture(scope="session")
def splade_dir(tmp_path_factory) -> Path:
    """A random BertForMaskedLM saved by sentence-transformers as a SPLADE SparseEncoder
    (MLMTransformer -> SpladePooling max), max_seq_length 32, with prompts (no default one)."""
    from tests.encoder.sparse_helpers import MAX_SEQ_LENGTH, PROMPTS
    from tooling.checkpoints import build_splade

    return build_splade(
        tmp_path_factory.mktemp("splade"), max_seq_length=MAX_SEQ_LENGTH, prompts=PROMPTS
    )


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory) -> Path:
    """A random CLIPModel with its tokenizer and image processor (tooling.vision_checkpoints)."""
    from tooling.vision_checkpoints import build_clip

    return build_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def siglip_dir(tmp_path_factory) -> Path:
    """A random SiglipModel with its tokenizer and image processor."""
    from tooling.vision_checkpoints import build_siglip

    return build_siglip(tmp_path_factory.mktemp("siglip"))
