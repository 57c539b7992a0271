"""A micro-batch of token sequences laid end to end, without padding."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedTokens:
    """Sequences concatenated into one [total_tokens] stream, in the given order.

    Nothing is padded: linear layers see [total_tokens, hidden]; attention keeps the
    sequences apart (see `backend_lib.encoder.attention`).
    """

    input_ids: torch.Tensor  # [T] int64
    token_type_ids: torch.Tensor | None  # [T] int64, None = all zeros
    lengths: list[int]
    starts: torch.Tensor  # [B] int64, first token of each sequence
    lengths_t: torch.Tensor  # [B] int64
    host_ids: torch.Tensor | None = None
    """[T] int64 on the host: input_ids as packed, for host-side batch building (no device sync)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def offsets_in_sequence(self) -> torch.Tensor:
        """[T] position of each token inside its own sequence (0-based)."""
        first = torch.repeat_interleave(self.starts, self.lengths_t, output_size=self.num_tokens)
        return torch.arange(self.num_tokens, device=self.input_ids.device) - first


def pack(
    sequences: Sequence[Sequence[int]],
    device: torch.device,
    type_ids: Sequence[Sequence[int]] | None = None,
) -> PackedTokens:
    """Pack non-empty token sequences (and optional token-type ids) onto `device`."""
    lengths = [len(s) for s in sequences]
    flat = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long)
    types = None
    if type_ids is not None:
        types = torch.tensor(list(itertools.chain.from_iterable(type_ids)), dtype=torch.long)
        types = types.to(device, non_blocking=True)
    lengths_cpu = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lengths_cpu, 0) - lengths_cpu
    return PackedTokens(
        input_ids=flat.to(device, non_blocking=True),
        token_type_ids=types,
        lengths=lengths,
        starts=starts.to(device, non_blocking=True),
        lengths_t=lengths_cpu.to(device, non_blocking=True),
        host_ids=flat,
    )
