"""Iteration-level continuous-batching scheduler over a paged KV cache.

Every `schedule()` call builds one step within `max_num_batched_tokens` and `max_num_seqs`. The
order is the `scheduling_policy`'s (core/request_queue.py): under fcfs, queues are first come
first served and running sequences in admission order; under priority, every queue and the running
list are sorted by (effective priority, arrival). "First" and "last" below are in that order.

0. while the first waiting sequence lacks a slot (`max_num_seqs`) or the free blocks for its first
   chunk, a running one is preempted (as in 1) so that it is admitted in 2: under priority the
   last running one, if the waiting one's effective priority is strictly better; under fair share
   (core/tenants.py) the newest of the tenant furthest over its share of slots, if the waiting
   one's tenant is under its own;
1. running sequences (decodes and ongoing prefill chunks), first to last, except the prefills that
   yield (`Order.outranked_prefills`): under priority or fair share those the first waiting or
   swapped sequence would be admitted before, and under priority those of a worse `priority` class
   than the best prefill to come (a step carries one class's prefill chunks). They run after 2, in
   the budget and blocks left, preempting nothing unless the step is otherwise empty (else none
   might progress); a worse class only if no better class's prefill made it into the step (2
   likewise admits or resumes no worse class's prefill then). When blocks
   run out, the last running sequence is preempted: recompute (blocks freed, full ones stay in the
   prefix cache; back to the waiting queue, at its front under fcfs) or swap (blocks copied to the
   host pool; recompute when that is full);
2. then, only if 1 preempted nothing, swapped sequences are resumed, and only once none is left
   swapped (under priority: once none left goes before the first waiting one), waiting sequences
   are admitted in queue order (split by tenant: the head of the tenant admission serves next,
   tenants at `max_running_per_tenant` skipped), reusing their longest cached prefix (computed
   under the same LoRA adapter: the adapter salts the hashes; a request asking for prompt logprobs
   reads no cached prefix, so every position is computed). With an offload tier
   (core/kv_offload.py) the cached prefix continues in host memory after the pool's last hit;
   a waiting sequence whose prefix blocks are still being read back from disk stops admission
   (and 0) until they are in, holding no slot or block meanwhile;
3. LoRA: running sequences use at most `max_loras` distinct adapters (the base model is free), so
   every step fits the device's adapter slots (core/adapter_budget.py). A swapped or waiting
   sequence whose adapter would be one too many stops resumption / admission (as a sequence that
   does not fit the pool does): it waits for running sequences of other adapters to finish, and no
   request after it in the queue overtakes it, so none starves. Which adapter occupies which slot
   (free slot first, else the least recently used one not needed by the step) is the runner's
   business (lora/slots.py).

4. speculative decoding: a running decode carrying draft tokens (`seq.spec_token_ids`, proposed
   by the engine before the step) computes them after its last token, within the budget: as
   many drafts as the budget leaves room for past the decode's own token, KV slots included.

5. images: a prefill chunk never ends inside an image whose tokens attend to each other both
   ways (Gemma 3; core/multimodal.py `chunk_end`): it ends before the image, or the sequence waits
   for a step whose budget holds the rest of the image (a prefix hit may end inside one).

After the runner executes the step, `update()` advances every scheduled sequence, appends the
sampled tokens and finishes sequences on token-level stops: EOS (unless ignore_eos),
stop_token_ids, max_tokens and max_model_len ("length"); stops other than length wait for
`min_tokens`. Stop *strings* need the detokenizer: the engine detects them and calls
`finish(seq, "stop", stop_reason=the_string)`, which may also turn a "length" finish of the same
step into "stop" (a stop string takes precedence, as in vLLM). A sequence that verified drafts
gets its accepted drafts plus one token, appended in order up to the first stop among them; the
slots of rejected drafts are freed, and only blocks full of accepted tokens reach the prefix cache.

Parallel sampling (n > 1): on the step where the parent samples its first token, the engine
passes n - 1 children (the prompt plus each child's own first token) to `update(..., forks=)`;
they share the prompt's blocks, copied on first write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from backend_lib.config import require
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.adapter_budget import AdapterBudget
from backend_lib.llm.core.kv_cache_manager import KVCacheManager
from backend_lib.llm.core.kv_offload import KVOffloader, OffloadMoves
from backend_lib.llm.core.multimodal import chunk_end
from backend_lib.llm.core.request_queue import Order, TenantQueue
from backend_lib.llm.core.sequence import Sequence, SequenceStatus
from backend_lib.llm.core.stop_checker import StopChecker
from backend_lib.llm.core.tenants import TenantLedger


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """InputError unless a prompt of this many tokens leaves room for one output token."""
    if num_prompt_tokens >= max_model_len:
        raise InputError(
            f"the prompt has {num_prompt_tokens} tokens, but max_model_len is "
            f"{max_model_len} (prompt plus output); at least one token must "
            "remain for the output"
        )


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: compute positions
    [seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens); with drafts, the last
    len(spec_token_ids) of them are the drafts, after the sequence's own tokens."""

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens verified this step (speculative decoding; only on a decode)."""
    start_position: int = field(init=False)
    """seq.num_computed_tokens when scheduled (update() advances the sequence afterwards)."""
    _samples: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.start_position = self.seq.num_computed_tokens
        own = self.num_new_tokens - len(self.spec_token_ids)
        self._samples = self.start_position + own == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        """True iff this chunk reaches the end of the sequence (last prefill chunk or a decode)."""
        return self._samples

    @property
    def is_decode(self) -> bool:
        """One new token of its own past the prompt (drafts aside); else a prefill chunk."""
        own = self.num_new_tokens - len(self.spec_token_ids)
        return own == 1 and self.start_position >= self.seq.num_prompt_tokens

    @property
    def input_token_ids(self) -> list[int]:
        """The num_new_tokens tokens this step computes: the sequence's, then the drafts."""
        start = self.start_position
        own = self.seq.token_ids[start : start + self.num_new_tokens - len(self.spec_token_ids)]
        return own + self.spec_token_ids


@dataclass
class SchedulerOutput:
    """One step. The runner applies, in this order, blocks_to_swap_out, blocks_to_swap_in and
    blocks_to_copy, then runs the forward pass: a block freed by a swap-out this step may already
    be the destination of a copy or of new K/V."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    """The runner builds one flattened batch from these, in this order."""
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block)."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block)."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src device block, dst device block), copy-on-write."""
    offload: OffloadMoves = field(default_factory=OffloadMoves)
    """The offload tier's copies (core/kv_offload.py): its stores before the swaps, its loads
    after the swap-ins."""
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    """Fraction of device blocks in use (ref_count > 0)."""
    prefix_cache_queries: int
    """Tokens looked up in the prefix cache at admission."""
    prefix_cache_hits: int
    """Tokens found there."""
    num_preemptions: int
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Adapter name -> running sequences under it."""
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    """Adapter name -> waiting or swapped sequences under it."""
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    """Tenant -> running sequences."""
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    """Tenant -> waiting sequences."""

    @classmethod
    def of(cls, scheduler: Scheduler) -> SchedulerStats:
        kv = scheduler.kv_cache_manager
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            kv_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            running_lora_adapters=_count_adapters(scheduler.running),
            waiting_lora_adapters=_count_adapters([*scheduler.waiting, *scheduler.swapped]),
            running_by_tenant=scheduler.tenants.running_counts(),
            waiting_by_tenant=dict(Counter(seq.tenant for seq in scheduler.waiting)),
        )


class Scheduler:
    """Admits, batches, preempts and retires sequences; see the module docstring for the policy."""

    def __init__(
        self,
        config: LLMConfig,
        num_blocks: int,
        num_host_blocks: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        tenant_weights: Mapping[str, float] | None = None,
        offload: KVOffloader | None = None,
    ) -> None:
        """`tenant_weights`: the `tenant_weights` file's (core/tenants.py), under fair share;
        `offload`: the prefix cache's offload tier (core/kv_offload.py)."""
        _check_sizes(config, num_blocks, max_model_len)
        self.config = config
        self.max_model_len = max_model_len
        self.stops = StopChecker(max_model_len, eos_token_ids)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, num_host_blocks, config.enable_prefix_caching, offload
        )
        self.tenants = TenantLedger.of(config, tenant_weights or {})
        self.order = Order(config.scheduling_policy, config.priority_aging_rate, self.tenants)
        self.waiting = self.order.waiting_queue()
        self.running: list[Sequence] = []
        """In the policy's order: the last one is the first preemption victim."""
        self.swapped = self.order.queue()  # resumed before tenants' turns: it was admitted
        self.adapters = AdapterBudget(config.max_loras if config.enable_lora else 0)
        self.num_preemptions = 0
        self._seqs: dict[int, Sequence] = {}
        self._requests: dict[str, list[Sequence]] = {}

    # --- requests --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises InputError (prompt too long) or QueueFullError."""
        if seq.num_prompt_tokens < 1 or seq.num_tokens != seq.num_prompt_tokens:
            raise InputError("the prompt must have at least one token")
        check_prompt_fits(seq.num_prompt_tokens, self.max_model_len)
        if len(self.waiting) >= self.config.max_queue_size:
            raise QueueFullError(
                f"queue full: {len(self.waiting)} requests waiting "
                f"(max_queue_size={self.config.max_queue_size})"
            )
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        self.check_tenant_queue(seq.tenant)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._register(seq)
        self.kv_cache_manager.prefetch(seq)  # reads from the disk tier start with the next step

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a running copy of `parent`, sharing its KV blocks (parallel sampling,
        copied on first write). The child's token_ids are the parent's computed tokens plus at
        least one more (usually the child's own first sampled token, checked for stops like any:
        the child may finish at once). Prefer `update(..., forks=...)`, which forks before the
        parent's own token can finish (and free) the parent."""
        _check_fork(parent, child)
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence id {child.seq_id} is already scheduled")
        self.kv_cache_manager.fork(parent, child)
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        child.num_offloaded_prompt_tokens = parent.num_offloaded_prompt_tokens
        self._register(child)
        self._run(child)
        self._check_stop(child)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence ("stop", "length", "abort" or "error") and free its blocks at once.

        On an already finished sequence only the reasons are replaced (e.g. a stop string found
        in the token that also reached max_tokens), except that an abort stays an abort.
        """
        if seq.is_finished:
            if seq.finish_reason != "abort":
                seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        if seq.status is SequenceStatus.RUNNING:
            self._unrun(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.swapped.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        del self._seqs[seq.seq_id]
        self.tenants.leave(seq)
        siblings = self._requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self._requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request with reason "abort"."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def check_tenant_queue(self, tenant: str) -> None:
        """TenantLimitError when `tenant` has max_queued_per_tenant requests waiting."""
        if isinstance(self.waiting, TenantQueue):
            self.waiting.check_room(tenant)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats.of(self)

    # --- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.order.sort_running(self.running)
        displaced = self._displace_for_waiting(out)
        late = self.order.outranked_prefills(self.running, self.waiting, self.swapped)
        first = [seq for seq in self.running if seq not in late]
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, first)
        if len(out.preempted) == displaced:
            loras = self.adapters.in_use(self.running)
            budget = self._resume_swapped(out, budget, loras)
            budget = self._admit_waiting(out, budget, loras)
        if late and not _carries_class_of(out, min(s.priority for s in late)):
            # They preempt nothing, unless nothing else runs: then one must, or none progresses.
            budget = self._schedule_running(out, budget, late, may_preempt=not out.scheduled)
        out.blocks_to_copy = self.kv_cache_manager.take_copies()
        out.offload = self.kv_cache_manager.take_offload_moves()
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[int, Seq[int] | int],
        forks: Mapping[int, Seq[Sequence]] | None = None,
    ) -> list[Sequence]:
        """Advance the step's sequences after the runner; returns those finished by it.

        `sampled` maps seq_id to the one token sampled (an int or a 1-element list) for each
        scheduled sequence whose chunk `samples`; one that verified d drafts gets its 1..d + 1
        emitted tokens (the accepted drafts, then the corrected or bonus token). `forks` maps
        such a parent's seq_id to new children (parallel sampling, see `fork`), forked once the
        parent's step is computed but before its own token is appended (so a parent stopping at
        once still shares its prompt).
        Finished children are included in the result. Sequences aborted meanwhile are skipped.
        """
        forks = forks or {}
        tokens = _sampled_tokens(output, sampled)  # validated before anything changes
        if not {item.seq.seq_id for item in output.scheduled if item.samples}.issuperset(forks):
            raise ValueError("forks must be keyed by sequences that sample in this step")
        self.tenants.charge(output.scheduled)  # computed now (an interrupted step never is)
        finished = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            if item.spec_token_ids:
                if self._update_verified(seq, tokens[seq.seq_id]):
                    finished.append(seq)
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(seq)
            if not item.samples:
                continue
            for child in forks.get(seq.seq_id, ()):
                self.fork(seq, child)
                if child.is_finished:
                    finished.append(child)
            (token,) = tokens[seq.seq_id]
            seq.append_token(token)
            if self._check_stop(seq):
                finished.append(seq)
        return finished

    def _update_verified(self, seq: Sequence, emitted: list[int]) -> bool:
        """A decode that verified drafts: append its emitted tokens up to the first stop, keep the
        K/V of the accepted ones, free the rejected ones' slots; returns whether it finished."""
        for token in emitted:
            seq.append_token(token)
            if self.stops.reason(seq) is not None:
                break
        # Every position but the last token's now holds the K/V of the token there: the decode's
        # own and the accepted drafts (the inputs that agreed with what was emitted).
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv_cache_manager.free_uncomputed_slots(seq)
        self.kv_cache_manager.cache_full_blocks(seq)
        return self._check_stop(seq)

    # --- internals -------------------------------------------------------------------------------

    def _register(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq
        self._requests.setdefault(seq.request_id, []).append(seq)
        self.tenants.enter(seq)

    def _run(self, seq: Sequence) -> None:
        """Into the running list (admitted, resumed or forked)."""
        seq.status = SequenceStatus.RUNNING
        self.order.add_running(self.running, seq)
        self.tenants.started(seq)

    def _unrun(self, seq: Sequence) -> None:
        """Out of the running list (preempted or finished)."""
        self.running.remove(seq)
        self.tenants.stopped(seq)

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, seqs: list[Sequence], may_preempt: bool = True
    ) -> int:
        # First to last. Under fcfs a running prefill is rarely older than a running decode: a
        # later sequence is only admitted with budget the earlier prefill left over, i.e. its last
        # chunk (or a chunk ended before an image computed whole, step 5), so decodes are seldom
        # stalled behind a long prompt. Under priority a prefill of
        # higher priority may take the budget first: that is the policy.
        kv = self.kv_cache_manager
        for seq in seqs:
            if budget == 0 or len(out.scheduled) >= self.config.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = _chunk_size(self.config, seq, seq.num_computed_tokens, budget)
            if num_new == 0:
                continue
            drafts = _take_drafts(seq, budget, self.max_model_len)
            num_new += len(drafts)
            while not kv.allocate_slots(seq, num_new):
                if drafts:  # drafts never cost another sequence its place
                    num_new, drafts = num_new - len(drafts), []
                    continue
                if not may_preempt:
                    break  # an outranked prefill waits for the next step rather than evict
                # Victim: the last; those before `seq` keep their place.
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, num_new, drafts))
                budget -= num_new
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        self._unrun(seq)
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        # Victims come newest first; prepending keeps the older ones in front.
        if self.config.preemption_mode == "swap" and kv.can_swap_out(seq):
            out.blocks_to_swap_out.extend(kv.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
        else:  # recompute, also the fallback when the host pool is full
            kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _displace_for_waiting(self, out: SchedulerOutput) -> int:
        """Step 0: while the first waiting sequence may displace a running one (`victim_for`)
        and lacks a slot or the free blocks for its first chunk, preempt that one (the waiting
        one's adapter permitting). Returns how many were preempted."""
        kv, count = self.kv_cache_manager, 0
        while self.waiting and self.running:
            seq = self.waiting.head()
            victim = None if seq is None else self.order.victim_for(seq, self.running)
            if victim is None:
                break
            if self.swapped and not self.order.goes_first(self.waiting, self.swapped):
                break  # a swapped sequence goes first: it resumes when there is room
            if not self.adapters.fits(seq, self.adapters.in_use(self.running)):
                break
            if kv.is_loading(seq):
                break
            prefix = kv.find_cached_prefix(seq)
            chunk = _chunk_size(
                self.config, seq, prefix.num_tokens, self.config.max_num_batched_tokens
            )
            if len(self.running) < self.config.max_num_seqs and kv.fits(prefix, chunk):
                break
            self._preempt(victim, out)
            count += 1
        return count

    def _resume_swapped(self, out: SchedulerOutput, budget: int, loras: set[int]) -> int:
        while self.swapped and _room_for_another(self.config, self.running, out, budget):
            if self.order.goes_first(self.waiting, self.swapped):
                break
            seq = self.swapped[0]
            if not self.adapters.fits(seq, set(loras)) or not self.tenants.may_run(seq.tenant):
                break
            if seq.num_uncomputed_tokens > 1 and _carries_class_of(out, seq.priority):
                break
            num_new = _chunk_size(self.config, seq, seq.num_computed_tokens, budget)
            if num_new == 0:
                break
            pairs = self.kv_cache_manager.swap_in(seq, num_new)
            if pairs is None:
                break
            self.adapters.fits(seq, loras)
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(pairs)
            budget = self._start_running(seq, num_new, out, budget)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, loras: set[int]) -> int:
        kv = self.kv_cache_manager
        while self.waiting and _room_for_another(self.config, self.running, out, budget):
            if self.swapped and not self.order.goes_first(self.waiting, self.swapped):
                break  # a swapped sequence goes first (under fcfs: while any is left)
            seq = self.waiting.head()
            if seq is None or not self.adapters.fits(seq, set(loras)):
                break
            if _carries_class_of(out, seq.priority):
                break  # under priority, a step carries one class's prefill chunks
            if kv.is_loading(seq) or kv.prefetch(seq):
                break  # its prefix is being read back from disk: it goes first once that is done
            prefix = kv.find_cached_prefix(seq)
            num_new = _chunk_size(self.config, seq, prefix.num_tokens, budget)
            if num_new == 0 or not kv.admit(seq, prefix, num_new):
                break
            self.adapters.fits(seq, loras)
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = prefix.num_tokens
                seq.num_offloaded_prompt_tokens = prefix.num_tier_tokens
            budget = self._start_running(seq, num_new, out, budget)
        return budget

    def _start_running(self, seq: Sequence, num_new: int, out: SchedulerOutput, budget: int) -> int:
        self._run(seq)
        out.scheduled.append(ScheduledSequence(seq, num_new))
        return budget - num_new

    def _check_stop(self, seq: Sequence) -> bool:
        """Finish the sequence if its last token stops it; returns whether it did."""
        reason = self.stops.reason(seq)
        if reason is None:
            return False
        self.finish(seq, reason, self.stops.stop_token(seq, reason))
        return True


def _check_sizes(config: LLMConfig, num_blocks: int, max_model_len: int) -> None:
    """ConfigError unless the pool holds a longest sequence and, without chunked prefill, one
    step holds a longest prompt."""
    require(max_model_len >= 1, "max_model_len", max_model_len, "must be >= 1")
    require(
        num_blocks * config.block_size >= max_model_len,
        "num_blocks",
        num_blocks,
        f"the KV pool holds {num_blocks * config.block_size} tokens, fewer than "
        f"max_model_len ({max_model_len})",
    )
    require(
        config.enable_chunked_prefill or config.max_num_batched_tokens >= max_model_len,
        "max_num_batched_tokens",
        config.max_num_batched_tokens,
        f"must be >= max_model_len ({max_model_len}) without chunked prefill",
    )


def _carries_class_of(out: SchedulerOutput, worse: int) -> bool:
    """Whether the step carries a prefill chunk of a priority better than `worse`."""
    return any(item.seq.priority < worse and not item.is_decode for item in out.scheduled)


def _chunk_size(config: LLMConfig, seq: Sequence, start: int, budget: int) -> int:
    """Tokens of `seq` to compute this step from position `start`; 0 when a prefill does not fit
    and may not be chunked, or its chunk would end inside an image computed whole."""
    num_uncomputed = seq.num_tokens - start
    if num_uncomputed <= budget:
        return num_uncomputed
    if not config.enable_chunked_prefill:
        return 0
    features = () if seq.request is None else seq.request.mm_features
    return max(chunk_end(features, start, start + budget) - start, 0)


def _room_for_another(
    config: LLMConfig, running: list[Sequence], out: SchedulerOutput, budget: int
) -> bool:
    return (
        budget > 0
        and len(running) < config.max_num_seqs
        and len(out.scheduled) < config.max_num_seqs
    )


def _take_drafts(seq: Sequence, budget: int, max_model_len: int) -> list[int]:
    """The drafts a running sequence verifies this step (consumed from spec_token_ids): only on a
    decode, as many as the budget holds beside the decode's own token, and none that would take
    it past max_model_len."""
    drafts, seq.spec_token_ids = seq.spec_token_ids, []
    if seq.num_uncomputed_tokens != 1:
        return []
    return drafts[: max(0, min(budget - 1, max_model_len - seq.num_tokens - 1))]


def _check_fork(parent: Sequence, child: Sequence) -> None:
    """ValueError unless `child` may be forked from `parent` (see `Scheduler.fork`)."""
    if parent.status is not SequenceStatus.RUNNING:
        raise ValueError(f"can only fork a running sequence, got {parent.status.name}")
    computed = parent.num_computed_tokens
    if child.token_ids[:computed] != parent.token_ids[:computed] or child.num_tokens <= computed:
        raise ValueError("the child must extend the parent's computed tokens")
    if child.num_prompt_tokens != parent.num_prompt_tokens:
        raise ValueError("the child must have the parent's prompt length")


def _count_adapters(seqs: Iterable[Sequence]) -> dict[str, int]:
    """Adapter name -> how many of `seqs` run under it."""
    counts: dict[str, int] = {}
    for seq in seqs:
        if seq.lora_request is not None:
            name = seq.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


def _sampled_tokens(
    output: SchedulerOutput, sampled: Mapping[int, Seq[int] | int]
) -> dict[int, list[int]]:
    """`update`'s tokens per sampling sequence, checked before anything changes."""
    tokens = {}
    for item in output.scheduled:
        if not item.samples or item.seq.is_finished:
            continue
        value = sampled.get(item.seq.seq_id)
        if value is not None and not isinstance(value, (list, tuple)):
            value = [value]  # a bare token (int, numpy or 0-d tensor)
        most = 1 + len(item.spec_token_ids)
        if value is None or not 1 <= len(value) <= most:
            expected = "one sampled token" if most == 1 else f"1 to {most} emitted tokens"
            raise ValueError(
                f"expected {expected} for sequence {item.seq.seq_id}, "
                f"got {value!r} (for n > 1, pass the other samples as forks)"
            )
        tokens[item.seq.seq_id] = [int(t) for t in value]
    return tokens
