"""Sentence-transformers pooling modes computed on packed hidden states."""

from __future__ import annotations

import torch

from backend_lib.encoder.packed_tokens import PackedTokens

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def pool(
    hidden: torch.Tensor,
    tokens: PackedTokens,
    modes: tuple[str, ...],
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] token states -> [B, H * len(modes)] float32, modes concatenated in order.

    Matches `sentence_transformers.models.Pooling` on right-padded batches: every token
    of a sequence is a real token here, so no mask is needed. `skip` ([B] int64, each below its
    sequence's length) leaves each sequence's first tokens out, as `include_prompt=False` masks
    the prompt (its [CLS] included): `cls` takes the first token kept, `weightedmean` keeps the
    tokens' own position weights.
    """
    hidden = hidden.float()  # sentence-transformers accumulates low-precision states in fp32
    lengths = tokens.lengths_t
    starts = tokens.starts
    kept, kept_lengths, skipped = hidden, lengths, None
    if skip is not None:
        offsets = tokens.offsets_in_sequence()
        first_kept = torch.repeat_interleave(skip, lengths, output_size=tokens.num_tokens)
        keep = offsets >= first_kept
        kept, kept_lengths = hidden[keep], lengths - skip
        starts, skipped = starts + skip, skip.to(hidden.dtype).unsqueeze(1)
    counts = kept_lengths.to(hidden.dtype).unsqueeze(1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[starts])
        elif mode == "lasttoken":
            out.append(hidden[tokens.starts + lengths - 1])
        elif mode == "max":
            out.append(torch.segment_reduce(kept, "max", lengths=kept_lengths, axis=0))
        elif mode == "mean":
            out.append(torch.segment_reduce(kept, "sum", lengths=kept_lengths, axis=0) / counts)
        elif mode == "mean_sqrt_len_tokens":
            total = torch.segment_reduce(kept, "sum", lengths=kept_lengths, axis=0)
            out.append(total / counts.sqrt())
        elif mode == "weightedmean":
            # Weights 1..L by position inside each sequence (skipped positions keep their place).
            weights = (tokens.offsets_in_sequence() + 1).to(hidden.dtype).unsqueeze(1)
            if skip is not None:
                weights = weights[keep]
            total = torch.segment_reduce(kept * weights, "sum", lengths=kept_lengths, axis=0)
            full = lengths.to(hidden.dtype).unsqueeze(1)
            weight_sum = full * (full + 1) / 2
            if skipped is not None:
                weight_sum = weight_sum - skipped * (skipped + 1) / 2
            out.append(total / weight_sum)
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
