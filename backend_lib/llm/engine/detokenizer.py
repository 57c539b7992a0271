"""Incremental detokenization for streaming, with stop strings.

Decoding token by token is wrong for BPE (a token's text depends on its neighbours: leading spaces,
byte-level merges) and for byte-fallback tokens (one character split over several tokens). So each
step decodes a small window of recent tokens twice, with and without the new ones, and emits only
the new suffix once it no longer ends in U+FFFD (an unfinished UTF-8 character): the prefix-offset /
read-offset technique of HF text-generation-inference and vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import tokenizers

from backend_lib.llm.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: importing transformers is slow
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded with the output so the first output token gets its context (leading space).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _decode_fn(
    tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """ids -> text for a `tokenizers.Tokenizer` or a transformers tokenizer.

    A fast transformers tokenizer is decoded by its backend: transformers' extra
    `clean_up_tokenization_spaces` step would make windows disagree with each other.
    """
    backend = (
        tokenizer
        if isinstance(tokenizer, tokenizers.Tokenizer)
        else getattr(tokenizer, "backend_tokenizer", None)
    )
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into streamed text deltas.

    Stop strings are matched across token boundaries. Unless `include_stop_str_in_output`, the
    last (longest stop - 1) characters are held back while streaming, so no part of a stop string
    ever reaches the client; `flush()` releases them at the end. Stops are ignored until
    `min_tokens` tokens have been added.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer | PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._decode = _decode_fn(tokenizer, params.skip_special_tokens)
        self._stops: list[str] = list(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = params.output_text_buffer_length
        # The decode window: ids[:read_offset] were already turned into text (or are prompt
        # context), ids[read_offset:] are the tokens whose text is not emitted yet.
        self._ids = self._prompt_context(list(prompt_token_ids))
        self._read_offset = self._clean_end(len(self._ids))
        self._num_tokens = 0
        self._num_emitted = 0
        self.text = ""
        """Output text decoded so far, cut at a matched stop string (held-back text included)."""
        self.stop_string: str | None = None
        """The stop string that ended the output, once one matched."""

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one output token. Returns (text to send now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        self._ids.append(token_id)
        self._num_tokens += 1
        new_text = self._decode_new(final=False)
        if self._match_stop(new_text):
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._holdback), False

    def flush(self) -> str:
        """At the end of the sequence: decode any unfinished character and release held text."""
        if not self.stopped:
            self._match_stop(self._decode_new(final=True))
        return self._emit(len(self.text))

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt tokens, extended back to a character boundary (a window starting
        mid-character may decode to U+FFFD: byte-fallback decoders then garble the whole run)."""
        start = max(len(prompt_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        for _ in range(3):  # at most 3 continuation bytes precede a character's last byte
            if start == 0 or not self._decode(prompt_ids[start:]).startswith(_REPLACEMENT_CHAR):
                break
            start -= 1
        return prompt_ids[start:]

    def _clean_end(self, offset: int) -> int:
        """Move the prompt/output boundary before trailing prompt tokens that end mid-character,
        so the output text starts with the character the output tokens complete."""
        for _ in range(4):  # a UTF-8 character has at most 4 bytes
            if offset == 0 or not self._decode(self._ids[:offset]).endswith(_REPLACEMENT_CHAR):
                break
            offset -= 1
        return offset

    def _decode_new(self, final: bool) -> str:
        """Decode the text the newest tokens add; '' while they end in an unfinished character."""
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        new_text = full_text[len(prefix_text) :]
        # The window moves on: the just-decoded tokens become the context of the next ones.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text

    def _match_stop(self, new_text: str) -> bool:
        """Cut `text` at the first stop string completed by `new_text` (earliest end, then longest)."""
        if not new_text or not self._stops or self._num_tokens < self._min_tokens:
            return False
        matches = []  # (end, -start, stop): the earliest end wins, then the longest
        for stop in self._stops:
            # Only matches ending inside new_text: earlier ones were checked on earlier tokens.
            start = self.text.find(stop, max(0, len(self.text) - len(new_text) - len(stop) + 1))
            if start >= 0:
                matches.append((start + len(stop), -start, stop))
        if not matches:
            return False
        end, neg_start, stop = min(matches)
        self.text = self.text[: end if self._include_stop else -neg_start]
        self.stop_string = stop
        return True

    def _emit(self, upto: int) -> str:
        """Send text[emitted:upto] (never text already sent)."""
        if upto <= self._num_emitted:
            return ""
        delta = self.text[self._num_emitted : upto]
        self._num_emitted = upto
        return delta
