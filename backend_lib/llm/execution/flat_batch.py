"""One step's chunks flattened into a single batch: token ids, positions and attention metadata
on the device, built on the host with numpy and moved with two copies (one int64 buffer, one
int32 buffer). The target model's runner and the draft model (spec_decode/draft_model.py) both
run their forwards on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend_lib.llm.execution.attention import AttentionMetadata


@dataclass
class FlatBatch:
    input_ids: torch.Tensor
    """[T] int64: every chunk's new tokens, chunk after chunk."""
    positions: torch.Tensor
    """[T] int64: each token's position in its sequence."""
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    """[R] int64: the rows whose logits are wanted."""


def flat_batch(
    tokens: np.ndarray,
    starts: np.ndarray,
    q_lens: np.ndarray,
    block_tables: list[list[int]],
    sample_indices: list[int],
    block_size: int,
    device: torch.device,
) -> FlatBatch:
    """`tokens` [T] int64: the chunks' new tokens; chunk b starts at position `starts[b]` and has
    `q_lens[b]` tokens, its KV in the blocks `block_tables[b]` (which may already hold blocks for
    later tokens: only those the context covers are used)."""
    num_tokens, batch_size = len(tokens), len(q_lens)
    max_query_len, seq_lens = int(q_lens.max()), starts + q_lens
    if max_query_len == 1 and num_tokens == batch_size:  # decodes only: one token each, at start
        query_start_loc, positions = np.arange(batch_size + 1), starts
        token_rows = np.arange(batch_size)
    else:
        query_start_loc = np.concatenate(([0], np.cumsum(q_lens)))
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, q_lens)
        token_rows = np.repeat(np.arange(batch_size), q_lens)
    blocks_used = -(-seq_lens // block_size)
    tables = np.zeros((batch_size, int(blocks_used.max())), dtype=np.int64)
    for b, (table, used) in enumerate(zip(block_tables, blocks_used.tolist(), strict=True)):
        tables[b, :used] = table[:used]
    slot_mapping = tables[token_rows, positions // block_size] * block_size + positions % block_size

    longs = torch.from_numpy(
        np.concatenate((tokens, positions, slot_mapping, np.array(sample_indices, dtype=np.int64)))
    )
    ints = torch.from_numpy(
        np.concatenate((query_start_loc, seq_lens, tables.ravel())).astype(np.int32)
    )
    longs, ints = longs.to(device), ints.to(device)
    # split_with_sizes: Tensor.split's Python wrapper costs more than the split itself here.
    input_ids, positions_t, slots, samples = longs.split_with_sizes(
        [num_tokens, num_tokens, num_tokens, len(sample_indices)]
    )
    qsl_t, seq_lens_t, tables_t = ints.split_with_sizes([batch_size + 1, batch_size, tables.size])
    meta = AttentionMetadata(
        qsl_t,
        seq_lens_t,
        tables_t.view(tables.shape),
        slots,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
    )
    return FlatBatch(input_ids, positions_t, meta, samples)
