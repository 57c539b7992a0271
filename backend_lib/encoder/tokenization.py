"""Client text -> token ids, with the size limits of an encoder model.

Uses the checkpoint's fast tokenizer exactly as sentence-transformers does (same special
tokens, `longest_first` truncation at max_seq_length, optional lower-casing), and checks
what a client sent before any work is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers.normalizers import Lowercase
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoTokenizer

from backend_lib.checkpoint import HF_OFFLINE_KWARGS
from backend_lib.errors import InputError


def _cut_to_bytes(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 form fits in `max_bytes`."""
    if len(text) * 4 <= max_bytes:  # a code point is at most 4 UTF-8 bytes
        return text
    data = text.encode("utf-8")
    return text if len(data) <= max_bytes else data[:max_bytes].decode("utf-8", "ignore")


class TextTokenizer:
    """Tokenizes single texts (embedding) or query-document pairs (cross-encoder).

    `max_text_bytes` bounds the UTF-8 size of each text: with truncation on, a longer text
    is cut to that many bytes before tokenizing (so a huge input costs bounded time; the
    tokens kept are the same as long as the first `max_length` tokens lie within the kept
    bytes); with truncation off it is an `InputError`.
    """

    def __init__(self, model_dir: Path, max_text_bytes: int, do_lower_case: bool = False):
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **HF_OFFLINE_KWARGS)
        if do_lower_case:
            self._lowercase()
        self.max_text_bytes = max_text_bytes
        # The tokenizer's own limit until the caller settles the model's max_seq_length.
        self.max_length: int = int(self.tokenizer.model_max_length)

    @property
    def model_max_length(self) -> int:
        """The tokenizer config's `model_max_length` (huge when unset)."""
        return int(self.tokenizer.model_max_length)

    def _lowercase(self) -> None:
        # As sentence-transformers' `do_lower_case`: prepend a Lowercase normalizer.
        backend = self.tokenizer.backend_tokenizer
        current = backend.normalizer
        steps = [Lowercase()] + ([current] if current is not None else [])
        backend.normalizer = NormalizerSequence(steps)

    def encode_texts(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids per text, special tokens included."""
        texts = self.checked(texts, truncate, "text")
        if not texts:  # the HF tokenizer fails on an empty batch
            return []
        encoded = self.tokenizer(
            texts,
            truncation=truncate,
            max_length=self.max_length if truncate else None,
            verbose=False,
        )["input_ids"]
        if not truncate:
            self.check_lengths(encoded, "text")
        return encoded

    def encode_pairs(
        self, queries: Sequence[str], documents: Sequence[str], truncate: bool
    ) -> list[tuple[list[int], list[int] | None]]:
        """(token ids, token type ids or None) per query-document pair."""
        if len(queries) != len(documents):
            raise InputError(
                f"got {len(queries)} queries but {len(documents)} documents; they must pair up"
            )
        queries = self.checked(queries, truncate, "query")
        documents = self.checked(documents, truncate, "document")
        if not queries:
            return []
        encoded = self.tokenizer(
            queries,
            documents,
            truncation="longest_first" if truncate else False,
            max_length=self.max_length if truncate else None,
            verbose=False,
        )
        ids = encoded["input_ids"]
        if not truncate:
            self.check_lengths(ids, "query-document pair")
        types = encoded.get("token_type_ids") or [None] * len(ids)
        return list(zip(ids, types, strict=True))

    def checked(self, texts: Sequence[str], truncate: bool, what: str) -> list[str]:
        """`texts` as strings within max_text_bytes (cut there when truncating, else refused)."""
        out = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"{what} {i}: expected a string, got {type(text).__name__}")
            cut = _cut_to_bytes(text, self.max_text_bytes)
            if cut is not text and not truncate:
                raise InputError(
                    f"{what} {i} is {len(text.encode('utf-8'))} bytes, over the limit of "
                    f"{self.max_text_bytes} bytes (max_text_bytes) and truncation is off"
                )
            out.append(cut)
        return out

    def check_lengths(self, encoded: list[list[int]], what: str) -> None:
        """Refuse an untruncated item longer than max_length, naming it."""
        for i, ids in enumerate(encoded):
            if len(ids) > self.max_length:
                raise InputError(
                    f"{what} {i} has {len(ids)} tokens, over the limit of {self.max_length} "
                    "(max_seq_length) and truncation is off"
                )
