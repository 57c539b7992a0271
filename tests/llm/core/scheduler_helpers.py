"""The scheduler tests' fake runner and helpers: a runner that simulates the paged KV cache.

The fake runner stores, in every KV slot it writes, the exact token prefix whose K/V a real model
would store there, applies swaps and copies as a real runner must, and checks that every position
a scheduled sequence attends to holds that sequence's own prefix. So wrong sharing, a missing
copy-on-write, a lost swap or a stale prefix-cache hit all fail, independently of how the
scheduler is written. Its "model" samples a deterministic function of the context, so each
sequence's expected output is known without any scheduling at all.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.core.scheduler import Scheduler, SchedulerOutput
from backend_lib.llm.core.sequence import Sequence, SequenceStatus

BS = 8
_seq_ids = itertools.count()


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % 97 + 3


def reference_output(token_ids: list[int], num_tokens: int) -> list[int]:
    tokens = list(token_ids)
    for _ in range(num_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(token_ids) :]


class FakeRunner:
    """Plays the model runner's part of the data contract on simulated KV memory."""

    def __init__(self, sched: Scheduler, num_host_blocks: int = 0) -> None:
        num_blocks = sched.kv_cache_manager.pool.num_blocks
        self.device: list[list[tuple | None]] = [[None] * BS for _ in range(num_blocks)]
        self.host: list[list[tuple | None]] = [[None] * BS for _ in range(num_host_blocks)]

    def apply_moves(self, out: SchedulerOutput) -> None:
        for device, host in out.blocks_to_swap_out:
            self.host[host] = list(self.device[device])
        for host, device in out.blocks_to_swap_in:
            self.device[device] = list(self.host[host])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])

    def execute(self, out: SchedulerOutput, sample=next_token) -> dict[int, list[int]]:
        self.apply_moves(out)
        # Per layer, a forward writes all new K/V before any attention reads.
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                self.device[seq.block_table[pos // BS]][pos % BS] = tuple(seq.token_ids[: pos + 1])
        sampled = {}
        for item in out.scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            for pos in range(end):
                slot = self.device[seq.block_table[pos // BS]][pos % BS]
                assert slot == tuple(seq.token_ids[: pos + 1]), (
                    f"seq {seq.seq_id} reads wrong K/V at {pos}"
                )
            if item.samples:
                sampled[seq.seq_id] = [sample(seq.token_ids)]
        return sampled

    def execute_dropped(self, out: SchedulerOutput) -> None:
        """A step interrupted in its forward (engine/step_interrupts.py): its block moves are
        applied, the layers that ran wrote K/V of their own (here a marker no prefix equals, so a
        later read of it fails), nothing is sampled and the scheduler is not updated."""
        self.apply_moves(out)
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                self.device[seq.block_table[pos // BS]][pos % BS] = ("dropped",)


def make_scheduler(
    num_blocks=64, num_host_blocks=0, max_model_len=64, eos=(), **config
) -> Scheduler:
    cfg = LLMConfig(**{"block_size": BS, **config})
    cfg.validate()
    return Scheduler(cfg, num_blocks, num_host_blocks, max_model_len, eos_token_ids=eos)


def make_seq(
    prompt, request_id=None, priority=0, arrival_time=None, tenant=None, **params
) -> Sequence:
    """A sequence arriving at its id's second (or `arrival_time`), of request `request_id` with
    `priority`, served for `tenant`."""
    seq_id = next(_seq_ids)
    request_id = request_id or f"req-{seq_id}"
    arrival_time = float(seq_id) if arrival_time is None else arrival_time
    params = SamplingParams(**params)
    request = EngineRequest(
        request_id, None, params, list(prompt), arrival_time, priority=priority, tenant=tenant
    )
    return Sequence(
        seq_id,
        request_id,
        list(prompt),
        len(prompt),
        params,
        arrival_time=arrival_time,
        request=request,
    )


def make_child(parent: Sequence, first_token: int) -> Sequence:
    """A parallel-sampling sibling: the parent's prompt plus its own first sampled token."""
    return Sequence(
        next(_seq_ids),
        parent.request_id,
        parent.prompt_token_ids + [first_token],
        parent.num_prompt_tokens,
        parent.sampling_params,
        parent.arrival_time,
        request=parent.request,
    )


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one scheduled step and of the block accounting."""
    cfg = sched.config
    kv = sched.kv_cache_manager
    assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled)
    assert 0 < out.num_batched_tokens <= cfg.max_num_batched_tokens or not out.scheduled
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled)
    for item in out.scheduled:
        seq = item.seq
        assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens > 0
        end = seq.num_computed_tokens + item.num_new_tokens
        assert end <= seq.num_tokens and len(seq.block_table) == kv.num_blocks_for(end)
        assert item.samples == (end == seq.num_tokens)
        if not cfg.enable_chunked_prefill:
            assert item.samples
    check_blocks(sched)


def check_blocks(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    owners = Counter(b for s in sched.running for b in s.block_table)
    assert [b.ref_count for b in kv.pool.blocks] == [owners[i] for i in range(kv.pool.num_blocks)]
    assert sorted(kv.pool.free_block_ids()) == [
        i for i in range(kv.pool.num_blocks) if not owners[i]
    ]
    host_owners = Counter(b for s in sched.swapped for b in kv.host_block_table(s))
    assert len(host_owners) == sum(host_owners.values())  # host blocks are never shared
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks - len(host_owners)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for seq in sched.swapped:
        assert seq.block_table == [] and kv.host_block_table(seq)
    assert sched.stats.kv_usage == pytest.approx(len(owners) / kv.pool.num_blocks)
    # The tenants' running counts are kept by hooks; they must match a recount.
    assert sched.stats.running_by_tenant == dict(Counter(s.tenant for s in sched.running))


def check_drained(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished() and not (sched.running or sched.waiting or sched.swapped)
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert sched.stats.kv_usage == 0.0


def step(
    sched: Scheduler, runner: FakeRunner, forks=None
) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    check_step(sched, out)
    finished = sched.update(out, runner.execute(out), forks)
    check_blocks(sched)
    return out, finished


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished():
        outputs.append(step(sched, runner)[0])
        assert len(outputs) < max_steps, "no progress"
    check_drained(sched)
    return outputs


def assert_reference_outputs(seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.output_token_ids == reference_output(seq.prompt_token_ids, seq.num_output_tokens)
