"""Captured decode steps: one CUDA graph per batch-size bucket (vLLM's `cudagraph_capture_sizes`),
replayed instead of launching the forward's dozen kernels per layer one by one from Python.

A step is taken (`DecodeGraphs.takes`) when every sequence decodes one token (no prefill chunk, no
drafts to verify), with no LoRA rows, images or prompt scoring, and at most the largest bucket of
sequences. Its inputs are copied into static buffers, the smallest bucket >= B is replayed, and the
sampling rows are selected from the bucket's hidden states afterwards, eagerly (the lm_head and
the sampler run outside the graph, as in vLLM).

The rows past B are padding: token 0 at position 0, KV slot -1 (never stored), a context of one
key in block 0 (read, never written; the row's result is dropped). Every op computes each row
independently of the others, so padding changes no real row's math (its bits may differ where a
GEMM picks another algorithm for the bucket's row count). The graphs read the block table at its
full width (ceil(max_model_len / block_size) blocks), so every kernel's launch shape is the
bucket's alone, whatever the contexts (the Triton kernels size their grids from shapes, never from
device data: kernels/paged_attention.py); the attention's key splits are then planned for the
longest context, not the step's.

Captured at load, once the KV pool exists, largest bucket first, all in one memory pool (the
smaller graphs reuse the largest one's memory, so a replay's output is valid until the next
replay). Each is run twice before its capture, on a side stream, so Triton's compilation and the
allocator's first requests happen outside it. The pool is held on top of the KV pool's sizing (a
decode bucket's activations: megabytes); the engine logs its size.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.execution.attention import AttentionMetadata
from backend_lib.llm.execution.step_batch import ModelInput
from kernels import KernelOps

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [N], positions [N], meta) -> the final-normed hidden states [N, hidden_size]."""
Replay = Callable[[], torch.Tensor]
"""Runs a captured forward again on its buffers' current contents; returns its output tensor."""
Capture = Callable[[Replay], Replay]
"""Turns a forward over static buffers into its replay (`cuda_graph_capture`)."""


def graphs_apply(config: LLMConfig, device: torch.device, ops: KernelOps) -> bool:
    """Whether an engine captures its decode steps: on CUDA unless `enforce_eager`, on one rank
    (no collective inside a graph), with kernels that need no host-side plan per step (the
    Triton set: a step without a host sync)."""
    return (
        device.type == "cuda"
        and not config.enforce_eager
        and config.world_size == 1
        and ops.plan_attention is None
    )


@dataclass(frozen=True)
class DecodeBuffers:
    """The static inputs every captured graph reads: a bucket of `rows` reads the first `rows`."""

    input_ids: torch.Tensor
    """[N] int64: each row's token."""
    positions: torch.Tensor
    """[N] int64: each row's position in its sequence."""
    slot_mapping: torch.Tensor
    """[N] int64: the cache slot each row's K/V goes to (-1: not stored)."""
    query_start_loc: torch.Tensor
    """[N + 1] int32: 0, 1, ..., N (one token per row), never rewritten."""
    seq_lens: torch.Tensor
    """[N] int32: each row's context length, its new token included."""
    block_tables: torch.Tensor
    """[N, W] int32: each row's KV blocks, W = ceil(max_model_len / block_size) (entries past a
    row's context are stale, never read)."""
    max_seq_len: int
    """Tokens the table's W blocks hold."""

    @classmethod
    def allocate(
        cls, rows: int, max_blocks: int, block_size: int, device: torch.device
    ) -> DecodeBuffers:
        longs = torch.zeros((3, rows), dtype=torch.int64, device=device)
        return cls(
            longs[0],
            longs[1],
            longs[2].fill_(-1),
            torch.arange(rows + 1, dtype=torch.int32, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
            torch.zeros((rows, max_blocks), dtype=torch.int32, device=device),
            max_blocks * block_size,
        )

    def meta(self, rows: int) -> AttentionMetadata:
        """The attention metadata of a bucket of `rows` (views of the buffers)."""
        return AttentionMetadata(
            self.query_start_loc[: rows + 1],
            self.seq_lens[:rows],
            self.block_tables[:rows],
            self.slot_mapping[:rows],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def fill(self, batch: ModelInput, rows: int) -> None:
        """Copy a decode batch of B <= rows sequences in, and make rows B..rows padding."""
        meta, b = batch.meta, len(batch.input_ids)
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if b < rows:
            self.input_ids[b:rows].zero_()
            self.positions[b:rows].zero_()
            self.slot_mapping[b:rows].fill_(-1)
            self.seq_lens[b:rows].fill_(1)
            self.block_tables[b:rows, 0].zero_()


def cuda_graph_capture(device: torch.device) -> Capture:
    """Capture on `device` into one shared memory pool: each forward runs twice on a side stream
    (Triton compiles, the allocator warms), then once under `torch.cuda.graph`."""
    pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)

    def capture(forward: Replay) -> Replay:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class DecodeGraphs:
    """The captured decode forwards of one model, by bucket (module docstring)."""

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        device: torch.device,
        capture: Capture | None = None,
    ):
        """`forward`: the model over static inputs (its KV caches bound); `sizes`: the buckets;
        `max_blocks`: block-table width (blocks of the longest sequence) of `block_size` tokens;
        `capture`: how to capture one bucket (default: CUDA graphs on `device`)."""
        self.sizes = tuple(sorted(set(sizes)))
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, block_size, device)
        capture = capture or cuda_graph_capture(device)
        self.replays: dict[int, Replay] = {}
        with torch.inference_mode():
            for rows in reversed(self.sizes):  # largest first: the others reuse its memory
                self.replays[rows] = capture(self._bucket_forward(forward, rows))

    def _bucket_forward(self, forward: Forward, rows: int) -> Replay:
        buffers, meta = self.buffers, self.buffers.meta(rows)
        return lambda: forward(buffers.input_ids[:rows], buffers.positions[:rows], meta)

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket that holds `num_seqs` decodes (at most the largest bucket)."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def takes(self, batch: ModelInput) -> bool:
        """Whether `batch` is a step the graphs run: decodes only, no LoRA, images, prompt scoring
        or per-token visibility limits, at most the largest bucket of sequences."""
        meta = batch.meta
        return (
            meta.max_query_len == 1
            and len(batch.input_ids) <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.buffers.block_tables.shape[1]
            and batch.lora is None
            and batch.prompt_rows is None
            and meta.visible_until is None
            and not batch.image_slices
            and not batch.row_features
        )

    def run(self, batch: ModelInput, output_rows: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states of `output_rows` (int64 [R], may repeat) of a batch that
        `takes` accepted: [R, hidden_size]."""
        rows = self.bucket(len(batch.input_ids))
        self.buffers.fill(batch, rows)
        return self.replays[rows]().index_select(0, output_rows)


def try_capture(build: Callable[[], DecodeGraphs], device: torch.device) -> DecodeGraphs | None:
    """`build()`'s graphs, logged with their pool's size; None (every step eager) when a capture
    fails, logged with why: the engine still serves, as with `enforce_eager`."""
    start, reserved = time.monotonic(), torch.cuda.memory_reserved(device)
    try:
        graphs = build()
    except RuntimeError as exc:
        log.warning("decode steps run eagerly: capturing their CUDA graphs failed: %s", exc)
        return None
    log.info(
        "captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.0f MiB",
        len(graphs.sizes),
        ",".join(map(str, graphs.sizes)),
        time.monotonic() - start,
        (torch.cuda.memory_reserved(device) - reserved) / 2**20,
    )
    return graphs
