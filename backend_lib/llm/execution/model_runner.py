"""ModelRunner: runs one scheduler step on the device.

Per step: apply the scheduler's block moves (swap out, swap in, copy-on-write), flatten all
scheduled chunks into one batch (flat_batch.py), run the model once, project only the sampling
rows to logits, sample.

Parallel sampling (n > 1): `execute(out, num_samples={seq_id: k})` samples k tokens from that
sequence's logits row (the row is repeated k times; a seeded request draws them in turn from
its one generator), returned as `sampled[seq_id]` of length k. The engine then forks children.

Structured outputs: given `constraints`, the step's constrained rows get their next-token bitmask
filled on a worker thread while the forward runs, applied to those logits rows before sampling
(`KernelOps.apply_token_bitmask`); a step without constrained rows does none of this.

LoRA (`enable_lora`): the step's adapters (at most max_loras, the scheduler's promise) are made
resident in device slots (lora/slots.py: free slot, else the least recently used one), the rows
are laid out adapter by adapter, and the model gets a `LoRABatch` mapping row runs to slots: one
batched LoRA call per projection covers every adapter of the step, base rows untouched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from backend_lib.config import require
from backend_lib.device import resolve_dtype
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.scheduler import ScheduledSequence, SchedulerOutput
from backend_lib.llm.core.sequence import Sequence
from backend_lib.llm.execution import workers
from backend_lib.llm.execution.attention import AttentionMetadata, select_kernel_ops
from backend_lib.llm.execution.checkpoint_quantization.layers import resolve_w4a16_activations
from backend_lib.llm.execution.flat_batch import flat_batch
from backend_lib.llm.execution.kv_pool import (
    GIB,
    KVCacheSpec,
    KVPool,
    blocks_in,
    check_fits_one_sequence,
    gpu_kv_cache_bytes,
    resolve_kv_cache_dtype,
)
from backend_lib.llm.execution.loader import (
    CheckpointInfo,
    as_checkpoint_info,
    check_parallelism,
    load_model,
)
from backend_lib.llm.execution.pipeline_parallel import NO_PIPELINE, PipelineStage
from backend_lib.llm.execution.prompt_logprobs import (
    PromptLogprobsChunk,
    PromptScoring,
    prompt_scoring,
    score_prompts,
)
from backend_lib.llm.execution.sampler import Sampler, SamplingRow, TokenLogprobs
from backend_lib.llm.execution.step_input import BlockMoves, LoRAStep, StepInput, StepMessage
from backend_lib.llm.execution.tensor_parallel import TensorParallel
from backend_lib.llm.execution.workers import WorkerGroup
from backend_lib.llm.lora.adapter import LoRAAdapter, LoRAModelSpec, LoRAModule, load_adapter
from backend_lib.llm.lora.batch import LoRABatch
from backend_lib.llm.lora.request import LoRARequest
from backend_lib.llm.lora.slots import LoRASlots
from backend_lib.llm.spec_decode.draft_model import DraftModel
from backend_lib.llm.spec_decode.verifier import DraftedSequence, Verified, drafted_sequence, verify
from backend_lib.llm.structured.manager import BitmaskBatch, StructuredOutputManager
from backend_lib.quantization import check_quantization, resolve_quantization
from kernels import lora_segments


@dataclass
class ModelInput:
    """One flattened step, on device, plus the host-side list of rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    """[R] int64: the flattened row whose logits each sample uses (repeated for k > 1)."""
    sample_rows: list[SamplingRow]
    """One per plain sample (the first len(sample_rows) of sample_indices)."""
    sample_seq_ids: list[int]
    drafted: list[DraftedSequence] = field(default_factory=list)
    """Sequences verifying drafts (speculative decoding): their d + 1 rows each are the rest of
    sample_indices, in this order."""
    lora: LoRABatch | None = None
    """Row runs -> adapter slots (None: every row on the base model)."""
    prompt_scorings: list[PromptScoring] = field(default_factory=list)
    """The chunks whose rows score prompt tokens (prompt_logprobs), in `prompt_rows` order."""
    prompt_rows: torch.Tensor | None = None
    """[S] int64: the flattened rows scoring prompt tokens (None: none this step)."""
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    """Filled by `ModelRunner.compute_logits`: seq_id -> its chunk's prompt-token scores."""
    step: StepInput | None = None
    """The host data this batch was built from (what the other tensor-parallel ranks get)."""


@dataclass
class ModelOutput:
    sampled: dict[int, list[int]] = field(default_factory=dict)
    """seq_id -> sampled tokens (one, or k when num_samples asked for k), for sampling seqs only."""
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    """seq_id -> logprobs of each sampled token, for seqs whose params.logprobs is not None."""
    bitmask: BitmaskBatch | None = None
    """The structured-output bitmask applied this step (None: no constrained row)."""
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    """seq_id -> the prompt tokens its chunk scored, for seqs whose params.prompt_logprobs is set."""
    drafts: dict[int, tuple[int, int]] = field(default_factory=dict)
    """seq_id -> (drafts verified, drafts accepted) for sequences that verified drafts; their
    `sampled` entry holds the accepted drafts plus one token."""


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


def _min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks each rank's memory allows), over the
    whole world: every tensor-parallel rank and pipeline stage."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _prompt_rows(
    scheduled: list[ScheduledSequence], layout: list[ScheduledSequence], q_lens: np.ndarray
) -> tuple[list[int], list[PromptScoring]]:
    """The flattened rows of chunks that score prompt tokens (prompt_logprobs), scheduled order,
    and those chunks' scorings."""
    first_row = {id(s): int(r) for s, r in zip(layout, np.cumsum(q_lens) - q_lens, strict=True)}
    rows: list[int] = []
    scorings: list[PromptScoring] = []
    for s in scheduled:
        scoring = prompt_scoring(s)
        if scoring is None:
            continue
        # The row at position p scores token p + 1: the chunk's rows from its first one on.
        first = first_row[id(s)]
        rows += range(first, first + len(scoring.token_ids))
        scorings.append(scoring)
    return rows, scorings


def row_layout(
    scheduled: list[ScheduledSequence], lora_slots: Mapping[int, int] | None = None
) -> list[ScheduledSequence]:
    """The order of a step's sequences in the flattened batch: decodes first, longest context
    first, then longer chunks. The CPU attention then takes each group of similar-length decodes
    as a slice of consecutive rows (no gather of q, no scatter of the output). With adapters
    (`lora_slots`: lora_int_id -> slot), decodes and chunks are each grouped by slot first (base
    model first), so each adapter's rows form few runs for the batched LoRA kernel."""
    slot_of = lora_slots or {}
    return sorted(
        scheduled,
        key=lambda s: (
            s.num_new_tokens > 1,
            slot_of.get(s.seq.lora_int_id, -1),
            -(s.seq.num_computed_tokens + s.num_new_tokens),
        ),
    )


class ModelRunner:
    """Owns the model, the KV pool and the sampler of one engine."""

    def __init__(
        self,
        config: LLMConfig,
        device: torch.device,
        checkpoint: CheckpointInfo | str | Path,
        draft_checkpoint: CheckpointInfo | None = None,
    ):
        """`checkpoint`: the loader's CheckpointInfo, or the directory to read it from. With
        several ranks (`LLMConfig.world_size` > 1) and no torch.distributed group yet, this is
        rank 0: it starts the other ranks' worker processes (execution/workers.py) and drives
        them. `draft_checkpoint`: speculative decoding's draft model (rank 0 only), loaded here
        so that its weights and KV cache come out of the same memory budget."""
        self.config, self.device = config, device
        self.checkpoint = as_checkpoint_info(checkpoint)
        self.draft_checkpoint = draft_checkpoint
        self.workers: WorkerGroup | None = None
        if config.world_size > 1:
            check_parallelism(
                self.checkpoint, config.tensor_parallel_size, config.pipeline_parallel_size
            )
        if config.world_size > 1 and (workers.driving() or not _in_process_group()):
            self.workers = WorkerGroup(config, self.checkpoint.model_dir, device)
        try:
            self._build(config, device)
        except BaseException as exc:
            if self.workers is not None:
                died = self.workers.failed_start()
                self.workers = None
                if died is not None:
                    raise died from exc
            raise

    def _build(self, config: LLMConfig, device: torch.device) -> None:
        self.dtype = resolve_dtype(config.dtype, device)
        self.block_size = config.block_size
        self.max_model_len = resolve_max_model_len(
            config.max_model_len, self.checkpoint.max_position_embeddings
        )
        self.ops = select_kernel_ops(config.kernel_backend, device)
        prequantized = self.checkpoint.quantization
        quantization = resolve_quantization(
            config.quantization, None if prequantized is None else prequantized.describe()
        )
        check_quantization(quantization, device)
        dynamic_int8 = resolve_w4a16_activations(config.w4a16_activations, self.dtype, device)
        kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, device)
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        self.tp = TensorParallel.from_process_group(tp_size, pp_size)
        self.pp = NO_PIPELINE
        if pp_size > 1:
            self.pp = PipelineStage.of_rank(dist.get_rank(), tp_size, pp_size)
        self.model = load_model(
            self.checkpoint,
            device,
            self.dtype,
            self.ops,
            self.max_model_len,
            quantization=quantization,
            dynamic_int8=dynamic_int8,
            tp=self.tp,
            pp=self.pp,
        )
        self.sampler = Sampler(self.checkpoint.eos_token_ids, device, config.seed)
        args = self.model.args
        self.kv_spec = KVCacheSpec(
            len(self.model.held_layers),  # a pipeline stage caches its own layers
            args.num_kv_heads,
            args.head_dim,
            config.block_size,
            kv_cache_dtype,
        )
        self.lora_spec = self._lora_spec(self.model.full_args)
        """What an adapter must match to run on this model (the whole model's shapes)."""
        self.lora_slots: LoRASlots | None = None
        if config.enable_lora:
            self.lora_slots = LoRASlots(
                self._lora_spec(args),  # this rank's shapes
                config.max_loras,
                config.max_lora_rank,
                device,
                self.dtype,
                shard=self._shard_lora if self.tp.size > 1 else None,
            )
        self._rank_adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        """On the other ranks: adapters loaded from the paths rank 0 names, by lora_int_id."""
        self.draft: DraftModel | None = None
        """Speculative decoding's draft model (None: no draft_model speculation)."""
        if self.draft_checkpoint is not None:
            self.draft = DraftModel(
                self.draft_checkpoint,
                device,
                self.dtype,
                self.ops,
                self.max_model_len,
                config.block_size,
                dynamic_int8,
                config.speculative.quantization,
            )
        # After the adapter slots and the draft, so that GPU sizing counts their memory.
        self.kv_pool = self._allocate_kv_pool()
        if self.draft is not None:
            self.draft.allocate(self.kv_pool.num_blocks)

    def _lora_spec(self, args) -> LoRAModelSpec:
        return LoRAModelSpec.for_llama(
            self.checkpoint.hf_config["architectures"][0],
            args.num_layers,
            args.hidden_size,
            args.intermediate_size,
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
            mlp=getattr(self.model, "LORA_COVERS_MLP", True),
        )

    def _shard_lora(self, layer: int, projection: str, module: LoRAModule):
        return self.tp.shard_lora(
            layer, projection, module.lora_a, module.lora_b, self.model.full_args
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers this rank started (none: nothing to do)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

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
    ) -> ModelOutput:
        """Run one SchedulerOutput: block moves, forward, sampling. `num_samples` maps seq_id to
        how many tokens to sample from that sequence's row (default 1); `constraints` holds the
        grammar state of constrained sequences (see the module docstring). A tensor-parallel
        worker that died fails the step with `WorkerDied` naming its rank."""
        try:
            return self._execute(sched_out, num_samples, constraints)
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
    ) -> ModelOutput:
        moves = BlockMoves.of(sched_out)
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
        logits = self.compute_logits(batch)
        output = ModelOutput(prompt_logprobs=batch.prompt_logprobs)
        if job is not None:
            output.bitmask = mask = job.result()
            with torch.inference_mode():
                self.ops.apply_token_bitmask(
                    logits, mask.bitmask.to(self.device), mask.rows.to(self.device)
                )
        if batch.drafted:
            num_plain = len(batch.sample_rows)
            with torch.inference_mode():
                verified = verify(logits[num_plain:], batch.drafted, self.sampler)
            self._record_verified(output, batch.drafted, verified)
            logits = logits[:num_plain]
        if not batch.sample_rows:  # only non-final prefill chunks (or drafted decodes) this step
            return output
        with torch.inference_mode():
            result = self.sampler(logits, batch.sample_rows)
        for seq_id, token, logprob in zip(
            batch.sample_seq_ids, result.token_ids, result.logprobs, strict=True
        ):
            output.sampled.setdefault(seq_id, []).append(token)
            if logprob is not None:
                output.logprobs.setdefault(seq_id, []).append(logprob)
        return output

    @staticmethod
    def _record_verified(
        output: ModelOutput, drafted: list[DraftedSequence], verified: list[Verified]
    ) -> None:
        """The emitted runs; a constrained sequence whose accepted drafts lead its grammar to a
        dead end is one (as plain decoding would find at its next step)."""
        mask = output.bitmask
        for d, v in zip(drafted, verified, strict=True):
            output.sampled[d.seq_id] = v.token_ids
            if v.logprobs is not None:
                output.logprobs[d.seq_id] = v.logprobs
            output.drafts[d.seq_id] = (v.num_drafts, v.num_accepted)
            dead_at = None if mask is None else mask.dead_after_drafts.get(d.seq_id)
            if dead_at is not None and v.num_accepted >= dead_at:
                mask.dead_seq_ids.append(d.seq_id)

    def run_step(self, message: StepMessage) -> None:
        """A tensor-parallel worker's share of rank 0's step: the same block moves and forward
        (its collectives included), no sampling."""
        self.apply_block_moves(message.moves)
        if message.step is not None:
            self.compute_logits(self.device_input(message.step))

    def apply_block_moves(self, moves: BlockMoves) -> None:
        """Swap out first (frees device blocks that swap-ins or copies may then reuse)."""
        self.kv_pool.swap_out(moves.swap_out)
        self.kv_pool.swap_in(moves.swap_in)
        self.kv_pool.copy_blocks(moves.copy)

    def compute_logits(self, batch: ModelInput) -> torch.Tensor | None:
        """Forward the flattened batch; float32 logits of the sampling rows only [R, vocab]. Rows
        scoring prompt tokens (`batch.prompt_rows`) are scored on the way, into
        `batch.prompt_logprobs`. A later pipeline stage runs its layers only: None."""
        rows = batch.sample_indices
        if batch.prompt_rows is not None:
            rows = torch.cat((rows, batch.prompt_rows))
        with torch.inference_mode():
            hidden = self.model(
                batch.input_ids,
                batch.positions,
                batch.meta,
                self.kv_pool.layer_caches,
                batch.lora,
                output_rows=rows,
            )
            if not self.pp.first:
                return None
            num_samples = len(batch.sample_indices)
            if batch.prompt_rows is not None:
                batch.prompt_logprobs = score_prompts(
                    hidden[num_samples:], batch.prompt_scorings, self.model.compute_logits
                )
            return self.model.compute_logits(hidden[:num_samples])

    def prepare_input(
        self, scheduled: list[ScheduledSequence], num_samples: Mapping[int, int] | None = None
    ) -> ModelInput:
        """Flatten ScheduledSequences (seq, num_new_tokens) into one device batch."""
        requests = [s.seq.lora_request for s in scheduled if s.seq.lora_request is not None]
        slot_of = self._activate_loras(requests)
        # Sampling rows (and so the logits rows) keep the scheduled order; token rows do not.
        layout = row_layout(scheduled, slot_of)
        step, rows, seq_ids, drafted = self._host_step(scheduled, layout, num_samples or {})
        if requests:
            adapters = [(r.lora_int_id, r.lora_name, r.lora_path) for r in requests]
            step = replace(step, lora=LoRAStep(adapters, [s.seq.lora_int_id for s in layout]))
        batch = self.device_input(step, rows, seq_ids, slot_of)
        batch.drafted = drafted
        return batch

    def _host_step(
        self,
        scheduled: list[ScheduledSequence],
        layout: list[ScheduledSequence],
        num_samples: Mapping[int, int],
    ) -> tuple[StepInput, list[SamplingRow], list[int], list[DraftedSequence]]:
        """The step's host data, with the sampling rows, their seq ids and the sequences
        verifying drafts (rank 0's alone)."""
        starts = np.array([s.seq.num_computed_tokens for s in layout], dtype=np.int64)
        q_lens = np.array([s.num_new_tokens for s in layout], dtype=np.int64)
        tokens: list[int] = []
        for s in layout:
            tokens += s.input_token_ids
        last_row = {id(s): int(end) - 1 for s, end in zip(layout, np.cumsum(q_lens), strict=True)}
        rows: list[SamplingRow] = []
        seq_ids: list[int] = []
        sample_indices: list[int] = []
        drafted: list[DraftedSequence] = []
        drafted_indices: list[int] = []
        for s in scheduled:
            if not s.samples:
                continue
            row = self._sampling_row(s.seq)
            last = last_row[id(s)]
            if s.spec_token_ids:  # its d + 1 rows go after every plain sample's
                drafted.append(drafted_sequence(s, row))
                drafted_indices += range(last - len(s.spec_token_ids), last + 1)
                continue
            k = num_samples.get(s.seq.seq_id, 1)
            rows += [row] * k
            seq_ids += [s.seq.seq_id] * k
            sample_indices += [last] * k
        prompt_rows, scorings = _prompt_rows(scheduled, layout, q_lens)
        step = StepInput(
            np.array(tokens, dtype=np.int64),
            starts,
            q_lens,
            [s.seq.block_table for s in layout],
            sample_indices + drafted_indices,
            prompt_rows,
            scorings,
        )
        return step, rows, seq_ids, drafted

    def device_input(
        self,
        step: StepInput,
        rows: list[SamplingRow] | None = None,
        seq_ids: list[int] | None = None,
        slot_of: Mapping[int, int] | None = None,
    ) -> ModelInput:
        """`step` as a device batch (with its sampling rows on rank 0; none on the others).
        `slot_of`: rank 0's adapter slots (lora_int_id -> slot); the other ranks activate the
        step's adapters themselves, in rank 0's order, so their slots are the same."""
        batch = self._device_input(
            step.tokens,
            step.starts,
            step.q_lens,
            step.block_tables,
            step.sample_indices,
            rows or [],
            seq_ids or [],
        )
        batch.step = step
        if step.lora is not None:
            if slot_of is None:
                slot_of = self._activate_loras(self._rank_requests(step.lora))
            segments = lora_segments(
                [slot_of.get(i, -1) for i in step.lora.row_ids], self.device, step.q_lens.tolist()
            )
            if segments is not None:
                batch.lora = LoRABatch(self.lora_slots, segments, self.ops)
        if step.prompt_rows:
            batch.prompt_rows = torch.tensor(step.prompt_rows, dtype=torch.long).to(self.device)
            batch.prompt_scorings = list(step.prompt_scorings)
        if self.ops.plan_attention is not None:
            meta = batch.meta
            meta.plan = self.ops.plan_attention(
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                self.kv_pool.layer_caches[0][0],
            )
        return batch

    def _activate_loras(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Load the step's adapters into slots; lora_int_id -> slot (empty: no adapter)."""
        if not requests:
            return {}
        if self.lora_slots is None:
            raise ValueError("a sequence has a LoRA adapter but enable_lora is off")
        return self.lora_slots.activate(requests)

    def _rank_requests(self, lora: LoRAStep) -> list[LoRARequest]:
        """On a rank other than 0: the step's adapters as requests, each loaded from the path rank
        0 named (once, then kept while among the max_cpu_loras most recently used)."""
        c = self.config
        requests = []
        for lora_id, name, path in lora.adapters:
            adapter = self._rank_adapters.get(lora_id)
            if adapter is None:
                adapter = load_adapter(name, Path(path), self.lora_spec, c.max_lora_rank)
                self._rank_adapters[lora_id] = adapter
                while len(self._rank_adapters) > max(c.max_cpu_loras, c.max_loras):
                    self._rank_adapters.popitem(last=False)
            self._rank_adapters.move_to_end(lora_id)
            requests.append(LoRARequest(name, lora_id, path, adapter))
        return requests

    def _device_input(
        self,
        tokens: np.ndarray,
        starts: np.ndarray,
        q_lens: np.ndarray,
        block_tables: list[list[int]],
        sample_indices: list[int],
        rows: list[SamplingRow],
        seq_ids: list[int],
    ) -> ModelInput:
        flat = flat_batch(
            tokens, starts, q_lens, block_tables, sample_indices, self.block_size, self.device
        )
        return ModelInput(
            flat.input_ids, flat.positions, flat.meta, flat.sample_indices, rows, seq_ids
        )

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.sampling_params
        if params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(params.seed)
        return SamplingRow(params, seq.token_ids, seq.num_prompt_tokens, seq.generator)

    # --- KV pool sizing ----------------------------------------------------------------------

    def _allocate_kv_pool(self) -> KVPool:
        c = self.config
        # The draft's pool has as many blocks as this one: a block costs both.
        specs = [self.kv_spec] if self.draft is None else [self.kv_spec, self.draft.kv_spec]
        if c.num_blocks > 0:
            num_blocks, key, value = c.num_blocks, "num_blocks", c.num_blocks
        elif self.device.type == "cuda":
            num_blocks = self._gpu_num_blocks(specs)
            key, value = "gpu_memory_utilization", c.gpu_memory_utilization
        else:
            num_blocks = blocks_in(c.cpu_kv_cache_gb * GIB, *specs)
            key, value = "cpu_kv_cache_gb", c.cpu_kv_cache_gb
        # Every rank's cache must hold the same blocks (the scheduler's ids index them all).
        if c.world_size > 1:
            num_blocks = _min_over_ranks(num_blocks, self.device)
        check_fits_one_sequence(num_blocks, self.max_model_len, self.block_size, key, value)
        num_host_blocks = (
            blocks_in(c.swap_space * GIB, self.kv_spec) if c.preemption_mode == "swap" else 0
        )
        return KVPool(self.kv_spec, num_blocks, num_host_blocks, self.device)

    def _gpu_num_blocks(self, specs: list[KVCacheSpec]) -> int:
        weights = torch.cuda.memory_allocated(self.device)
        activation_peak = self._profile_activation_peak()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = gpu_kv_cache_bytes(
            total, self.config.gpu_memory_utilization, weights, activation_peak, non_torch
        )
        return blocks_in(budget, *specs)

    def _profile_activation_peak(self) -> int:
        """Peak memory (bytes) of a worst-case step: max_num_batched_tokens of prefill in
        sequences of up to max_model_len, max_num_seqs logits rows, a sampler-like sort."""
        budget, max_len = self.config.max_num_batched_tokens, self.max_model_len
        lengths = [max_len] * (budget // max_len) + ([budget % max_len] if budget % max_len else [])
        q_lens = np.array(lengths, dtype=np.int64)
        blocks_per_seq = -(-q_lens // self.block_size)
        first = np.concatenate(([0], np.cumsum(blocks_per_seq)))
        tables = [list(range(first[i], first[i + 1])) for i in range(len(lengths))]
        num_rows = min(self.config.max_num_seqs, budget)
        ends = np.cumsum(q_lens) - 1
        sample_indices = [int(ends[i % len(ends)]) for i in range(num_rows)]
        scratch_pool = KVPool(self.kv_spec, int(first[-1]), 0, self.device)
        batch = self._device_input(
            np.zeros(budget, dtype=np.int64),
            np.zeros_like(q_lens),
            q_lens,
            tables,
            sample_indices,
            [],
            [],
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden = self.model(
                batch.input_ids, batch.positions, batch.meta, scratch_pool.layer_caches
            )
            logits = None
            if self.pp.first:  # the stage that holds the lm_head and samples
                logits = self.model.compute_logits(hidden[batch.sample_indices])
                logits.softmax(dim=-1).sort(dim=-1, descending=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch_pool, batch, hidden, logits
        return peak
