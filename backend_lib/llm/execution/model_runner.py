"""ModelRunner: runs one scheduler step on the device.

Per step: apply the scheduler's block moves (swap out, swap in, copy-on-write), send the step to
the other tensor-parallel ranks, flatten all scheduled chunks into one batch (step_batch.py), run
the model once, project only the sampling rows to logits, sample (step_sampling.py).

Parallel sampling (n > 1): `execute(out, num_samples={seq_id: k})` samples k tokens from that
sequence's logits row (the row is repeated k times; a seeded request draws them in turn from
its one generator), returned as `sampled[seq_id]` of length k. The engine then forks children.

Structured outputs: given `constraints`, the step's constrained rows get their next-token bitmask
filled on a worker thread while the forward runs, applied to those logits rows before sampling
(`KernelOps.apply_token_bitmask`); a step without constrained rows does none of this.

LoRA (`enable_lora`): the step's adapters (at most max_loras, the scheduler's promise) are made
resident in device slots (runner_lora.py, lora/slots.py), the rows are laid out adapter by
adapter, and the model gets a `LoRABatch` mapping row runs to slots: one batched LoRA call per
projection covers every adapter of the step, base rows untouched.

Speculative decoding: the drafted rows' logits come back masked, unverified, in
`ModelOutput.draft_logits` (verification is spec_decode's, above this layer). A draft model is
loaded here, by the `DraftLoader` the engine passes, so that its weights and KV cache come out of
the same memory budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from backend_lib.config import require
from backend_lib.device import resolve_dtype
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.scheduler import ScheduledSequence, SchedulerOutput
from backend_lib.llm.execution import workers
from backend_lib.llm.execution.attention import select_kernel_ops
from backend_lib.llm.execution.checkpoint_quantization.layers import resolve_w4a16_activations
from backend_lib.llm.execution.decode_graphs import (
    Capture,
    DecodeGraphs,
    graphs_apply,
    try_capture,
)
from backend_lib.llm.execution.kv_offload_store import build_offload_store
from backend_lib.llm.execution.kv_pool import KVCacheSpec, KVPool, resolve_kv_cache_dtype
from backend_lib.llm.execution.kv_sizing import allocate_kv_pool, measure_peak, worst_case_step
from backend_lib.llm.execution.kv_tier_files import checkpoint_fingerprint
from backend_lib.llm.execution.loader import (
    CheckpointInfo,
    as_checkpoint_info,
    check_parallelism,
    load_model,
)
from backend_lib.llm.execution.mm_embeds import EncoderCache, step_embeds
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.prompt_logprobs import score_prompts
from backend_lib.llm.execution.runner_lora import RunnerLoRA
from backend_lib.llm.execution.sampler import Sampler
from backend_lib.llm.execution.step_batch import ModelInput, StepBatcher
from backend_lib.llm.execution.step_input import BlockMoves, StepMessage
from backend_lib.llm.execution.step_interrupt import Interrupt, StepInterrupted
from backend_lib.llm.execution.step_sampling import ModelOutput, sample_step
from backend_lib.llm.execution.tensor_parallel import TensorParallel
from backend_lib.llm.execution.workers import WorkerGroup
from backend_lib.llm.kv_offload_config import DISK_STAGING_STEPS, KVOffloadConfig
from backend_lib.llm.multimodal_config import MultiModalConfig
from backend_lib.llm.structured.manager import StructuredOutputManager
from backend_lib.quantization import check_quantization, resolve_quantization
from kernels import KernelOps


@dataclass(frozen=True)
class ModelSettings:
    """What the runner resolved for its model; a draft model loads under the same."""

    device: torch.device
    dtype: torch.dtype
    ops: KernelOps
    max_model_len: int
    """Tokens (prompt and output) a sequence may reach."""
    block_size: int
    """Tokens per KV block."""
    dynamic_int8: bool
    """The resolved `w4a16_activations`: 4-bit layers quantize their activations to int8."""


class DraftCache(Protocol):
    """A draft model as the runner sees it: a KV cache sized with the target's."""

    kv_spec: KVCacheSpec

    def allocate(self, num_blocks: int) -> None: ...


DraftLoader = Callable[[ModelSettings], DraftCache]
"""Loads speculative decoding's draft model under the target's settings (spec_decode/)."""


def resolve_max_model_len(setting: int, max_position_embeddings: int) -> int:
    """0 takes the checkpoint's limit; beyond it the model was never trained (and rotary tables end)."""
    if setting == 0:
        return max_position_embeddings
    require(
        setting <= max_position_embeddings,
        "max_model_len",
        setting,
        f"exceeds the checkpoint's max_position_embeddings ({max_position_embeddings})",
    )
    return setting


def _in_process_group() -> bool:
    """Whether this process already is a rank of a torch.distributed group (a worker, or a rank
    its launcher joined): then it builds its shard and starts no workers."""
    return dist.is_available() and dist.is_initialized()


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one engine."""

    def __init__(
        self,
        config: LLMConfig,
        device: torch.device,
        checkpoint: CheckpointInfo | str | Path,
        draft_loader: DraftLoader | None = None,
        offload: KVOffloadConfig | None = None,
    ):
        """`checkpoint`: the loader's CheckpointInfo, or the directory to read it from. With
        several ranks (`LLMConfig.world_size` > 1) and no torch.distributed group yet, this is
        rank 0: it starts the other ranks' worker processes (execution/workers.py) and drives
        them. `draft_loader`: loads speculative decoding's draft model (rank 0 only). `offload`:
        the offload tier's resolved settings (default: `KVOffloadConfig.of(config)`)."""
        self.config, self.device = config, device
        self.checkpoint = as_checkpoint_info(checkpoint)
        self.workers: WorkerGroup | None = None
        if config.world_size > 1:
            check_parallelism(
                self.checkpoint, config.tensor_parallel_size, config.pipeline_parallel_size
            )
        if config.world_size > 1 and (workers.driving() or not _in_process_group()):
            self.workers = WorkerGroup(config, self.checkpoint.model_dir, device)
        try:
            self._build(config, device, draft_loader, offload or KVOffloadConfig.of(config))
        except BaseException as exc:
            if self.workers is not None:
                died = self.workers.failed_start()
                self.workers = None
                if died is not None:
                    raise died from exc
            raise

    def _build(
        self,
        config: LLMConfig,
        device: torch.device,
        draft_loader: DraftLoader | None,
        offload: KVOffloadConfig | None,
    ) -> None:
        self.settings = settings = self._resolve_settings(config, device)
        self.dtype, self.ops = settings.dtype, settings.ops
        self.block_size, self.max_model_len = settings.block_size, settings.max_model_len
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tp = TensorParallel.from_process_group(tp_size, pp_size)
        self.pp = NO_PIPELINE
        if pp_size > 1:
            self.pp = PipelineStage.of_rank(dist.get_rank(), tp_size, pp_size)
        self.model = self._load_target(config, settings)
        self.sampler = Sampler(self.checkpoint.eos_token_ids, device, config.seed)
        args = self.model.args
        kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, device)
        self.kv_spec = KVCacheSpec(
            len(self.model.held_layers),  # a pipeline stage caches its own layers
            args.num_kv_heads,
            args.head_dim,
            config.block_size,
            kv_cache_dtype,
        )
        architecture = self.checkpoint.hf_config["architectures"][0]
        self.lora = RunnerLoRA(config, self.model, architecture, self.tp, device, self.dtype)
        self.draft: DraftCache | None = None if draft_loader is None else draft_loader(settings)
        """Speculative decoding's draft model (None: no draft_model speculation)."""
        # After the adapter slots and the draft, so that GPU sizing counts their memory.
        specs = [self.kv_spec] if self.draft is None else [self.kv_spec, self.draft.kv_spec]
        self.kv_pool = allocate_kv_pool(
            config, device, specs, self.max_model_len, self._profile_activation_peak
        )
        if self.draft is not None:
            self.draft.allocate(self.kv_pool.num_blocks)
        self.offload = build_offload_store(
            offload,
            self.kv_pool,
            self._tier_identity(config),
            dist.get_rank() if _in_process_group() else 0,
            DISK_STAGING_STEPS * -(-config.max_num_batched_tokens // config.block_size),
        )
        """The prefix cache's offload tier on this rank (None: kv_offloading_backend none)."""
        self.batcher = StepBatcher(
            device, self.block_size, self.ops, self.lora, self.kv_pool.layer_caches[0][0]
        )
        self.encoder_cache = None
        """Image encoder outputs by digest (None: a text-only model)."""
        if hasattr(self.model, "encode_images"):
            self.encoder_cache = EncoderCache(MultiModalConfig.of(config).encoder_cache_size)
        self.decode_graphs: DecodeGraphs | None = None
        """Captured decode steps (decode_graphs.py); None: every step runs eagerly."""
        if graphs_apply(config, device, self.ops):
            sizes = config.capture_sizes
            self.decode_graphs = try_capture(lambda: self.capture_decode_graphs(sizes), device)

    def capture_decode_graphs(
        self, sizes: Sequence[int], capture: Capture | None = None
    ) -> DecodeGraphs:
        """The model's decode forward captured per batch-size bucket of `sizes` (`capture`:
        default CUDA graphs), over this runner's KV caches."""
        caches = self.kv_pool.layer_caches

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
            return self.model(input_ids, positions, meta, caches)

        max_blocks = -(-self.max_model_len // self.block_size)
        return DecodeGraphs(forward, sizes, max_blocks, self.block_size, self.device, capture)

    def _tier_identity(self, config: LLMConfig) -> dict:
        """What block files on disk must have been computed with to be reused."""
        spec = self.kv_spec
        return {
            "model": checkpoint_fingerprint(self.checkpoint.model_dir),
            "dtype": str(spec.dtype),
            "quantization": config.quantization,
            "block_size": spec.block_size,
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "world_size": [config.tensor_parallel_size, config.pipeline_parallel_size],
        }

    def _resolve_settings(self, config: LLMConfig, device: torch.device) -> ModelSettings:
        dtype = resolve_dtype(config.dtype, device)
        return ModelSettings(
            device,
            dtype,
            select_kernel_ops(config.kernel_backend, device),
            resolve_max_model_len(config.max_model_len, self.checkpoint.max_position_embeddings),
            config.block_size,
            resolve_w4a16_activations(config.w4a16_activations, dtype, device),
        )

    def _load_target(self, config: LLMConfig, settings: ModelSettings):
        prequantized = self.checkpoint.quantization
        quantization = resolve_quantization(
            config.quantization, None if prequantized is None else prequantized.describe()
        )
        check_quantization(quantization, settings.device)
        return load_model(
            self.checkpoint,
            settings.device,
            settings.dtype,
            settings.ops,
            settings.max_model_len,
            quantization=quantization,
            dynamic_int8=settings.dynamic_int8,
            tp=self.tp,
            pp=self.pp,
        )

    @property
    def lora_spec(self):
        """What an adapter must match to run on this model (the whole model's shapes)."""
        return self.lora.spec

    @property
    def lora_slots(self):
        return self.lora.slots

    def close(self) -> None:
        """Stop the tier's threads and the tensor-parallel workers this rank started."""
        if self.offload is not None:
            self.offload.close()
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    @property
    def interruptible(self) -> bool:
        """Whether `execute` may cut a step short (step_interrupt.py): on a single rank only."""
        return self.config.world_size == 1

    @property
    def num_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.kv_pool.num_host_blocks

    # --- one step ----------------------------------------------------------------------------

    def execute(
        self,
        sched_out: SchedulerOutput,
        num_samples: Mapping[int, int] | None = None,
        constraints: StructuredOutputManager | None = None,
        interrupt: Interrupt | None = None,
    ) -> ModelOutput:
        """Run one SchedulerOutput: block moves, forward, sampling. `num_samples` maps seq_id to
        how many tokens to sample from that sequence's row (default 1); `constraints` holds the
        grammar state of constrained sequences (see the module docstring). A tensor-parallel
        worker that died fails the step with `WorkerDied` naming its rank.

        `interrupt` (step_interrupt.py): asked before each layer, True drops the step after its
        block moves with StepInterrupted; ignored when the step runs on several ranks."""
        if not self.interruptible:
            interrupt = None
        try:
            return self._execute(sched_out, num_samples, constraints, interrupt)
        except RuntimeError as exc:  # a collective with a rank gone (gloo/NCCL errors)
            died = None if self.workers is None else self.workers.died(wait=2.0)
            if died is not None:
                raise died from exc
            raise

    def _execute(
        self,
        sched_out: SchedulerOutput,
        num_samples: Mapping[int, int] | None,
        constraints: StructuredOutputManager | None,
        interrupt: Interrupt | None,
    ) -> ModelOutput:
        moves = BlockMoves.of(sched_out)
        if self.offload is not None:  # first: a read asked for is always started (and reported)
            self.offload.prefetch(moves.offload.read)
        batch = None
        if sched_out.scheduled:
            batch = self.prepare_input(sched_out.scheduled, num_samples)
        if self.workers is not None and (moves or batch is not None):
            self.workers.send(StepMessage(moves, None if batch is None else batch.step))
        self.apply_block_moves(moves)
        if batch is None:
            return ModelOutput()
        job = None
        if constraints is not None and (batch.sample_rows or batch.drafted):
            drafts = [(d.seq_id, d.draft_token_ids) for d in batch.drafted]
            job = constraints.begin(batch.sample_seq_ids, drafts)  # fills while the forward runs
        try:
            logits = self.compute_logits(batch, interrupt)
        except StepInterrupted:
            if job is not None:
                job.result()  # it reads the matchers, which the next step's update advances
            raise
        return sample_step(logits, batch, self.sampler, self.ops, job)

    def run_step(self, message: StepMessage) -> None:
        """A tensor-parallel worker's share of rank 0's step: the same block moves and forward
        (its collectives included), no sampling."""
        if self.offload is not None:
            self.offload.prefetch(message.moves.offload.read)
        self.apply_block_moves(message.moves)
        if message.step is not None:
            self.compute_logits(self.batcher.device_input(message.step))

    def unread(self, reads: list[tuple[bytes, int]]) -> set:
        """Of these disk reads (block hash, RAM slot), the blocks some rank could not read
        intact: each rank reads its own shard's file (every rank, when there are several)."""
        failed = self.offload.await_reads(reads)
        if self.workers is not None:
            failed = self.workers.check_reads(reads, failed)
        return failed

    def apply_block_moves(self, moves: BlockMoves) -> None:
        """Tier stores first (the evicted blocks' K/V before anything overwrites it), swap out
        (frees device blocks that swap-ins, tier loads or copies may then reuse), swap in, tier
        loads, copies."""
        if self.offload is not None:
            self.offload.store(moves.offload)
        self.kv_pool.swap_out(moves.swap_out)
        self.kv_pool.swap_in(moves.swap_in)
        if self.offload is not None:
            self.offload.load(moves.offload)
        self.kv_pool.copy_blocks(moves.copy)

    def prepare_input(
        self, scheduled: list[ScheduledSequence], num_samples: Mapping[int, int] | None = None
    ) -> ModelInput:
        """Flatten ScheduledSequences (seq, num_new_tokens) into one device batch."""
        return self.batcher.prepare_input(scheduled, num_samples)

    def compute_logits(
        self, batch: ModelInput, interrupt: Interrupt | None = None
    ) -> torch.Tensor | None:
        """Forward the flattened batch; float32 logits of the sampling rows only [R, vocab]. Rows
        scoring prompt tokens (`batch.prompt_rows`) are scored on the way, into
        `batch.prompt_logprobs`. A later pipeline stage runs its layers only: None. `interrupt`:
        see `execute`."""
        rows = batch.sample_indices
        if batch.prompt_rows is not None:
            rows = torch.cat((rows, batch.prompt_rows))
        with torch.inference_mode():
            graphs = self.decode_graphs
            if graphs is not None and graphs.takes(batch):
                if interrupt is not None and interrupt():
                    raise StepInterrupted
                return self.model.compute_logits(graphs.run(batch, batch.sample_indices))
            extra, positions = {}, batch.positions
            if batch.image_slices:
                extra["mm_embeds"] = step_embeds(
                    batch.image_slices, self.model.encode_images, self.encoder_cache, self.device
                )
            rope_positions = getattr(self.model, "rope_positions", None)
            if rope_positions is not None and batch.row_features:  # M-RoPE: [3, T]
                step = batch.step
                positions = rope_positions(batch.row_features, step.starts, step.q_lens)
                positions = positions.to(self.device)
            hidden = self.model(
                batch.input_ids,
                positions,
                batch.meta,
                self.kv_pool.layer_caches,
                batch.lora,
                output_rows=rows,
                interrupt=interrupt,
                **extra,
            )
            if not self.pp.first:
                return None
            num_samples = len(batch.sample_indices)
            if batch.prompt_rows is not None:
                batch.prompt_logprobs = score_prompts(
                    hidden[num_samples:], batch.prompt_scorings, self.model.compute_logits
                )
            return self.model.compute_logits(hidden[:num_samples])

    def _profile_activation_peak(self) -> int:
        """Peak memory (bytes) of a worst-case step (kv_sizing.worst_case_step), with a
        sampler-like sort over its logits."""
        q_lens, tables, sample_indices = worst_case_step(self.config, self.max_model_len)
        scratch_pool = KVPool(self.kv_spec, sum(len(t) for t in tables), 0, self.device)
        batcher = StepBatcher(self.device, self.block_size, self.ops, self.lora)
        tokens = np.zeros(int(q_lens.sum()), dtype=np.int64)
        batch = batcher.flat_input(tokens, np.zeros_like(q_lens), q_lens, tables, sample_indices)

        def run() -> None:
            hidden = self.model(
                batch.input_ids, batch.positions, batch.meta, scratch_pool.layer_caches
            )
            if self.pp.first:  # the stage that holds the lm_head and samples
                logits = self.model.compute_logits(hidden[batch.sample_indices])
                logits.softmax(dim=-1).sort(dim=-1, descending=True)

        return measure_peak(self.device, run)  # the scratch pool goes with this frame
