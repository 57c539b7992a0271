"""Token-level stops: whether the token a sequence just appended finishes it (vLLM's order: EOS
and stop_token_ids once `min_tokens` are out, then max_model_len and max_tokens as "length").
Stop *strings* need the detokenizer and are the engine's (engine/output_processor.py)."""

from __future__ import annotations

from collections.abc import Iterable

from backend_lib.llm.core.sequence import Sequence


class StopChecker:
    """The stops one engine applies to every sequence after each appended token."""

    def __init__(self, max_model_len: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.max_model_len = max_model_len
        """Prompt plus output tokens, at most."""
        self.eos_token_ids = frozenset(eos_token_ids)
        """The checkpoint's end-of-sequence token ids (ignored under `ignore_eos`)."""

    def reason(self, seq: Sequence) -> str | None:
        """ "stop", "length" or None (goes on), for `seq`'s last token."""
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            token = seq.last_token_id
            if (
                token in self.eos_token_ids and not params.ignore_eos
            ) or token in params.stop_token_ids:  # type: ignore[operator]
                return "stop"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    @staticmethod
    def stop_token(seq: Sequence, reason: str) -> int | None:
        """vLLM's stop_reason for a token-level stop: the stop token id, None for EOS or length."""
        token = seq.last_token_id
        is_stop_id = reason == "stop" and token in seq.sampling_params.stop_token_ids  # type: ignore[operator]
        return token if is_stop_id else None
