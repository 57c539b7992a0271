"""Sentence-transformers pooling modes computed on packed hidden states."""

from __future__ import annotations

import torch

from backend_lib.encoder.packed_tokens import PackedTokens

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def pool(hidden: torch.Tensor, tokens: PackedTokens, modes: tuple[str, ...]) -> torch.Tensor:
    """[T, H] token states -> [B, H * len(modes)] float32, modes concatenated in order.

    Matches `sentence_transformers.models.Pooling` on right-padded batches: every token
    of a sequence is a real token here, so no mask is needed.
    """
    hidden = hidden.float()  # sentence-transformers accumulates low-precision states in fp32
    lengths = tokens.lengths_t
    counts = lengths.to(hidden.dtype).unsqueeze(1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[tokens.starts])
        elif mode == "lasttoken":
            out.append(hidden[tokens.starts + lengths - 1])
        elif mode == "max":
            out.append(torch.segment_reduce(hidden, "max", lengths=lengths, axis=0))
        elif mode == "mean":
            out.append(torch.segment_reduce(hidden, "sum", lengths=lengths, axis=0) / counts)
        elif mode == "mean_sqrt_len_tokens":
            out.append(torch.segment_reduce(hidden, "sum", lengths=lengths, axis=0) / counts.sqrt())
        elif mode == "weightedmean":
            # Weights 1..L by position inside each sequence.
            weights = (tokens.offsets_in_sequence() + 1).to(hidden.dtype).unsqueeze(1)
            total = torch.segment_reduce(hidden * weights, "sum", lengths=lengths, axis=0)
            out.append(total / (counts * (counts + 1) / 2))
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
