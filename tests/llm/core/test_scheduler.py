"""Scheduler driven by a fake runner that simulates the paged KV cache (scheduler_helpers.py):
admission, chunked prefill, prefix caching, both preemption modes, forks, stops and aborts, and
random workloads whose outputs must continue their contexts exactly."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from backend_lib.config import ConfigError
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.core.sequence import Sequence, SequenceStatus
from tests.llm.core.scheduler_helpers import (
    BS,
    FakeRunner,
    assert_reference_outputs,
    check_blocks,
    check_drained,
    check_step,
    make_child,
    make_scheduler,
    make_seq,
    next_token,
    reference_output,
    run,
    step,
)

# --- admission, chunked prefill ------------------------------------------------------------------


def test_chunked_prefill_splits_prompt_and_keeps_decodes_running():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    short = make_seq(range(4), max_tokens=8)
    sched.add(short)
    step(sched, runner)
    long = make_seq(range(100, 140), max_tokens=2)
    sched.add(long)
    chunks, decodes = [], []
    while long.num_output_tokens == 0:
        out, _ = step(sched, runner)
        by_seq = {i.seq.seq_id: i for i in out.scheduled}
        decodes.append(by_seq[short.seq_id].num_new_tokens)
        chunks.append((by_seq[long.seq_id].num_new_tokens, by_seq[long.seq_id].samples))
        assert out.scheduled[0].seq is short  # decodes first
    assert chunks == [(15, False), (15, False), (10, True)]
    assert decodes == [1, 1, 1]
    run(sched, runner)
    assert_reference_outputs([short, long])
    assert (short.finish_reason, long.finish_reason) == ("length", "length")


def test_without_chunked_prefill_a_prompt_waits_for_its_whole_budget():
    sched = make_scheduler(
        max_num_batched_tokens=40, enable_chunked_prefill=False, max_model_len=40
    )
    runner = FakeRunner(sched)
    firsts = [make_seq(range(i, i + 4), max_tokens=3) for i in range(2)]
    for seq in firsts:
        sched.add(seq)
    step(sched, runner)
    fits, too_big = make_seq(range(30), max_tokens=1), make_seq(range(50, 89), max_tokens=1)
    sched.add(too_big)
    sched.add(fits)
    out, _ = step(sched, runner)
    # 39 tokens do not fit next to two decodes; FCFS keeps `fits` behind it as well.
    assert [i.seq for i in out.scheduled] == firsts
    while any(s.status is SequenceStatus.RUNNING for s in firsts):
        step(sched, runner)
    out, _ = step(sched, runner)
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(too_big, 39)]
    run(sched, runner)
    assert_reference_outputs([*firsts, fits, too_big])


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    seqs = [make_seq(range(i, i + 5), max_tokens=3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    outputs = run(sched, runner)
    assert max(len(o.scheduled) for o in outputs) == 2
    assert_reference_outputs(seqs)
    # First come, first served.
    first_step = {
        s.seq_id: next(n for n, o in enumerate(outputs) if s in [i.seq for i in o.scheduled])
        for s in seqs
    }
    assert [first_step[s.seq_id] for s in seqs] == sorted(first_step.values())


# --- prefix cache --------------------------------------------------------------------------------


def test_prefix_cache_hits_counted_in_tokens():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    base = list(range(100, 120))
    a = make_seq(base, max_tokens=2)
    sched.add(a)
    run(sched, runner)
    b = make_seq(base[:17] + [1, 2, 3], max_tokens=4)  # shares 2 full blocks
    c = make_seq(base[:16], max_tokens=4)  # whole prompt cached: last block recomputed
    d = make_seq([7] * 9, max_tokens=4)
    for seq in (b, c, d):
        sched.add(seq)
    first = sched.schedule()
    assert [i.num_new_tokens for i in first.scheduled] == [4, 8, 9]
    assert [s.num_cached_prompt_tokens for s in (b, c, d)] == [16, 8, 0]
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (
        20 + 20 + 16 + 9,
        24,
    )
    sched.update(first, runner.execute(first))
    run(sched, runner)
    assert_reference_outputs([a, b, c, d])


def test_prefix_caching_disabled_computes_everything():
    sched = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(sched)
    for _ in range(2):
        sched.add(make_seq(range(20), max_tokens=2))
        out = run(sched, runner)
        assert out[0].num_batched_tokens == 20
    assert sched.stats.prefix_cache_hits == 0


# --- preemption ----------------------------------------------------------------------------------


def test_recompute_preemption_evicts_newest_and_resumes_exactly():
    # 5 blocks of 8 = 40 token slots; three sequences growing to 26 tokens cannot all fit.
    sched = make_scheduler(num_blocks=5, max_model_len=40)
    runner = FakeRunner(sched)
    seqs = [make_seq(range(10 * i, 10 * i + 6), max_tokens=20) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    preempted_at = None
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        if out.preempted and preempted_at is None:
            preempted_at = out
            victim = out.preempted[0]
            assert victim is seqs[2]  # the most recently admitted
            assert sched.waiting[0] is victim and victim.num_computed_tokens == 0
            assert victim.num_output_tokens > 0
            hits_before = sched.stats.prefix_cache_hits
    assert preempted_at is not None and sched.stats.num_preemptions >= 1
    # Re-admission found the victim's own full blocks in the prefix cache.
    assert sched.stats.prefix_cache_hits > hits_before
    check_drained(sched)
    assert_reference_outputs(seqs)
    assert all(s.num_output_tokens == 20 for s in seqs)


def test_victim_is_the_newest_even_when_an_older_sequence_needs_the_block():
    sched = make_scheduler(num_blocks=4, max_model_len=32)
    runner = FakeRunner(sched)
    oldest = make_seq(range(8), max_tokens=4)  # its first decode needs a second block
    others = [make_seq(range(20 + 3 * i, 23 + 3 * i), max_tokens=4) for i in range(3)]
    for seq in [oldest, *others]:
        sched.add(seq)
    step(sched, runner)
    later = make_seq(range(60, 63), max_tokens=4)
    sched.add(later)  # no free block: stays waiting
    out, _ = step(sched, runner)
    assert out.preempted == [others[-1]]
    assert [i.seq for i in out.scheduled] == [oldest, *others[:-1]]
    assert list(sched.waiting) == [others[-1], later]  # the victim goes to the front
    run(sched, runner)
    assert_reference_outputs([oldest, *others, later])


def test_swap_preemption_round_trip():
    sched = make_scheduler(
        num_blocks=5, num_host_blocks=8, max_model_len=40, preemption_mode="swap"
    )
    runner = FakeRunner(sched, num_host_blocks=8)
    seqs = [make_seq(range(10 * i, 10 * i + 6), max_tokens=20) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    outputs = run(sched, runner)
    swap_outs = [o for o in outputs if o.blocks_to_swap_out]
    swap_ins = [o for o in outputs if o.blocks_to_swap_in]
    assert swap_outs and swap_ins and swap_outs[0] is not swap_ins[0]
    first = swap_outs[0]
    assert first.preempted[0].status is not SequenceStatus.WAITING
    assert all(not o.blocks_to_swap_in for o in swap_outs)  # never both in one step
    assert_reference_outputs(seqs)


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    sched = make_scheduler(
        num_blocks=5, num_host_blocks=1, max_model_len=40, preemption_mode="swap"
    )
    runner = FakeRunner(sched, num_host_blocks=1)
    seqs = [make_seq(range(10 * i, 10 * i + 6), max_tokens=20) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    outputs = run(sched, runner)
    assert any(o.preempted and not o.blocks_to_swap_out for o in outputs)  # fell back
    assert all(len(o.blocks_to_swap_out) <= 1 for o in outputs)
    assert_reference_outputs(seqs)


# --- parallel sampling: fork + copy-on-write -----------------------------------------------------


def test_fork_shares_prompt_blocks_and_copies_on_write():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    parent = make_seq(range(12), request_id="par", max_tokens=6)
    sched.add(parent)
    out = sched.schedule()
    sampled = runner.execute(out)
    children = [make_child(parent, 200 + i) for i in range(2)]
    sched.update(out, sampled, forks={parent.seq_id: children})
    full, partial = parent.block_table
    assert all(c.block_table == [full, partial] for c in children)
    assert sched.kv_cache_manager.pool.blocks[partial].ref_count == 3
    out, _ = step(sched, runner)
    # Two of the three writers into the shared partial block get private copies.
    assert [src for src, _ in out.blocks_to_copy] == [partial, partial]
    assert len({s.block_table[1] for s in [parent, *children]}) == 3
    assert sched.kv_cache_manager.pool.blocks[full].ref_count == 3
    run(sched, runner)
    for seq in [parent, *children]:
        first = seq.output_token_ids[0]
        assert seq.output_token_ids[1:] == reference_output(seq.prompt_token_ids + [first], 5)
    assert len({tuple(s.output_token_ids) for s in [parent, *children]}) == 3


def test_fork_survives_the_parent_stopping_on_its_first_token():
    eos = next_token(list(range(12)))
    sched = make_scheduler(eos=[eos])
    runner = FakeRunner(sched)
    parent = make_seq(range(12), request_id="p", max_tokens=4)
    sched.add(parent)
    out = sched.schedule()
    child, stopping_child = make_child(parent, 5), make_child(parent, eos)
    finished = sched.update(
        out, runner.execute(out), forks={parent.seq_id: [child, stopping_child]}
    )
    assert finished == [stopping_child, parent]
    assert parent.finish_reason == "stop" and parent.stop_reason is None
    assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 12
    run(sched, runner)
    assert child.output_token_ids == [5] + reference_output(list(range(12)) + [5], 3)


def test_fork_preconditions():
    sched = make_scheduler()
    parent = make_seq(range(4))
    sched.add(parent)
    with pytest.raises(ValueError, match="running"):
        sched.fork(parent, make_seq(range(5)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="sample"):
        sched.update(out, {parent.seq_id: [1]}, forks={12345: []})
    with pytest.raises(ValueError, match="expected one sampled token"):
        sched.update(out, {parent.seq_id: [1, 2]})
    sched.update(out, {parent.seq_id: 1})
    assert parent.token_ids == [0, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="extend"):
        sched.fork(parent, make_seq([9, 9, 9, 9, 9]))
    with pytest.raises(ValueError, match="prompt length"):
        sched.fork(parent, make_seq(parent.token_ids + [3]))


# --- stops, limits -------------------------------------------------------------------------------


def test_token_stops_and_min_tokens():
    prompt = list(range(5))
    ref = reference_output(prompt, 12)
    eos = ref[3]
    assert eos not in ref[:3]
    sched = make_scheduler(eos=[eos])
    runner = FakeRunner(sched)
    stops_at_eos = make_seq(prompt, max_tokens=12)
    ignores_eos = make_seq(prompt, max_tokens=12, ignore_eos=True)
    stop_id = make_seq(prompt, max_tokens=12, stop_token_ids=[ref[1]], ignore_eos=True)
    late = make_seq(prompt, max_tokens=12, min_tokens=ref.index(eos) + 2)
    for seq in (stops_at_eos, ignores_eos, stop_id, late):
        sched.add(seq)
    run(sched, runner)
    assert (stops_at_eos.output_token_ids, stops_at_eos.finish_reason) == (ref[:4], "stop")
    assert stops_at_eos.stop_reason is None
    assert (ignores_eos.output_token_ids, ignores_eos.finish_reason) == (ref, "length")
    assert (stop_id.output_token_ids, stop_id.stop_reason) == (ref[:2], ref[1])
    later = [i for i, t in enumerate(ref) if t == eos and i + 1 >= late.sampling_params.min_tokens]
    expected = ref[: later[0] + 1] if later else ref
    assert late.output_token_ids == expected


def test_max_model_len():
    sched = make_scheduler(max_model_len=24)
    with pytest.raises(InputError) as excinfo:
        sched.add(make_seq(range(24)))
    assert "24 tokens" in str(excinfo.value) and "max_model_len is 24" in str(excinfo.value)
    runner = FakeRunner(sched)
    almost = make_seq(range(23), max_tokens=10)
    unbounded = make_seq(range(10), max_tokens=None)
    sched.add(almost)
    sched.add(unbounded)
    run(sched, runner)
    assert (almost.num_output_tokens, almost.finish_reason) == (1, "length")
    assert (unbounded.num_tokens, unbounded.finish_reason) == (24, "length")
    assert_reference_outputs([almost, unbounded])


def test_queue_full():
    sched = make_scheduler(max_queue_size=2)
    sched.add(make_seq([1]))
    sched.add(make_seq([1]))
    with pytest.raises(
        QueueFullError, match=r"queue full: 2 requests waiting \(max_queue_size=2\)"
    ):
        sched.add(make_seq([1]))
    sched.schedule()  # both admitted: the queue has room again
    sched.add(make_seq([1]))


def test_construction_checks():
    with pytest.raises(ConfigError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=3, max_model_len=25)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        make_scheduler(max_model_len=64, enable_chunked_prefill=False, max_num_batched_tokens=32)


def test_finish_reason_override_by_stop_string():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    seq = make_seq(range(3), max_tokens=1)
    sched.add(seq)
    run(sched, runner)
    assert seq.finish_reason == "length"
    sched.finish(seq, "stop", stop_reason="###")  # the engine found a stop string in that token
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "###")
    check_drained(sched)


# --- abort ---------------------------------------------------------------------------------------


def test_abort_in_every_state():
    sched = make_scheduler(
        num_blocks=5,
        num_host_blocks=8,
        max_model_len=40,
        preemption_mode="swap",
        max_num_batched_tokens=8,
    )
    runner = FakeRunner(sched, num_host_blocks=8)
    waiting = make_seq(range(3), request_id="w")
    sched.add(waiting)
    assert [s.finish_reason for s in sched.abort("w")] == ["abort"]
    assert sched.abort("w") == [] and not sched.has_unfinished()

    prefilling = make_seq(range(20), request_id="pf")
    sched.add(prefilling)
    step(sched, runner)
    assert 0 < prefilling.num_computed_tokens < 20 and prefilling.block_table
    sched.abort("pf")
    check_blocks(sched)
    assert prefilling.block_table == [] and sched.stats.kv_usage == 0.0

    seqs = [
        make_seq(range(10 * i, 10 * i + 6), request_id=f"s{i}", max_tokens=30) for i in range(3)
    ]
    for seq in seqs:
        sched.add(seq)
    while not sched.swapped:
        step(sched, runner)
    swapped = sched.swapped[0]
    sched.abort(swapped.request_id)
    assert swapped.finish_reason == "abort" and sched.kv_cache_manager.host_pool.usage == 0.0
    check_blocks(sched)

    # Between schedule() and update(): the step's result for it is dropped.
    out = sched.schedule()
    victim = out.scheduled[0].seq
    sampled = runner.execute(out)
    sched.abort(victim.request_id)
    sched.update(out, sampled)
    assert victim.status is SequenceStatus.FINISHED and victim.finish_reason == "abort"
    for seq in seqs:
        if not seq.is_finished:
            sched.abort(seq.request_id)
    check_drained(sched)


def test_abort_request_with_forked_sequences():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    parent = make_seq(range(12), request_id="n3", max_tokens=8)
    sched.add(parent)
    out = sched.schedule()
    children = [make_child(parent, 100 + i) for i in range(2)]
    sched.update(out, runner.execute(out), forks={parent.seq_id: children})
    step(sched, runner)
    aborted = sched.abort("n3")
    assert set(map(id, aborted)) == set(map(id, [parent, *children]))
    check_drained(sched)


# --- random workloads ----------------------------------------------------------------------------


@st.composite
def workloads(draw):
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(12, 40))
    config = dict(
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(3 if chunked else max_model_len, 48)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        priority_aging_rate=draw(st.sampled_from([0.0, 0.5])),
    )
    num_blocks = draw(st.integers(-(-max_model_len // BS), 10))
    num_host_blocks = draw(st.integers(0, 8))
    # Prompts are prefixes of two base texts, so they often share full blocks (prefix-cache hits).
    bases = draw(
        st.lists(
            st.lists(st.integers(3, 99), min_size=max_model_len, max_size=max_model_len),
            min_size=2,
            max_size=2,
        )
    )
    requests = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "arrival": st.integers(0, 15),
                    "base": st.integers(0, 1),
                    "length": st.integers(1, max_model_len - 1),
                    "tweak": st.booleans(),
                    "max_tokens": st.one_of(st.none(), st.integers(1, 12)),
                    "n": st.integers(1, 3),
                    "abort": st.one_of(st.none(), st.integers(0, 30)),
                    "priority": st.integers(-2, 3),
                }
            ),
            min_size=2,
            max_size=10,
        )
    )
    return config, num_blocks, num_host_blocks, max_model_len, bases, requests


def _request(length: int, priority: int, arrival: int = 0, n: int = 1) -> dict:
    return dict(
        arrival=arrival,
        base=0,
        length=length,
        tweak=False,
        max_tokens=None,
        n=n,
        abort=None,
        priority=priority,
    )


# Found by hypothesis: two prefills outranked by a better waiting request that could not displace
# either (aging made it tie with the last running one) needed a block each, and none was free.
DEADLOCKED_LATE_PREFILLS = (
    dict(
        preemption_mode="recompute",
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        max_num_seqs=2,
        max_num_batched_tokens=3,
        scheduling_policy="priority",
        priority_aging_rate=0.5,
    ),
    4,
    0,
    26,
    [[3] * 26, [3] * 26],
    [
        _request(1, 0),
        _request(1, 0, n=2),
        _request(25, 3),
        _request(1, 1, arrival=1),
        _request(1, 0),
        _request(1, 2),
    ],
)


@settings(max_examples=100, deadline=None)
@given(workload=workloads())
@example(workload=DEADLOCKED_LATE_PREFILLS)
def test_random_workloads_keep_invariants(workload):
    config, num_blocks, num_host_blocks, max_model_len, bases, requests = workload
    eos = 50
    sched = make_scheduler(num_blocks, num_host_blocks, max_model_len, eos=[eos], **config)
    runner = FakeRunner(sched, num_host_blocks)
    pending = sorted(enumerate(requests), key=lambda r: r[1]["arrival"])
    parents: dict[int, tuple[Sequence, int]] = {}
    all_seqs: list[Sequence] = []
    children: set[int] = set()  # their first token is forced, not the model's
    for now in itertools.count():
        assert now < 600, "no progress"
        while pending and pending[0][1]["arrival"] <= now:
            index, req = pending.pop(0)
            prompt = bases[req["base"]][: req["length"]]
            if req["tweak"]:
                prompt[-1] += 100
            priority = req["priority"] if config["scheduling_policy"] == "priority" else 0
            seq = make_seq(
                prompt,
                request_id=f"r{index}",
                priority=priority,
                max_tokens=req["max_tokens"],
                n=req["n"],
            )
            sched.add(seq)
            all_seqs.append(seq)
            parents[seq.seq_id] = (seq, req["n"])
        for index, req in enumerate(requests):
            if req["abort"] == now:
                sched.abort(f"r{index}")
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        out = sched.schedule()
        check_step(sched, out)
        for name in ("preempted", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
            if getattr(out, name):
                event(name)
        sampled = runner.execute(out)
        forks = {}
        for item in out.scheduled:
            seq = item.seq
            if item.samples and seq.seq_id in parents and seq.num_output_tokens == 0:
                _, n = parents.pop(seq.seq_id)
                forks[seq.seq_id] = [
                    make_child(seq, eos if k == 1 else 60 + k) for k in range(1, n)
                ]
                all_seqs.extend(forks[seq.seq_id])
                children.update(c.seq_id for c in forks[seq.seq_id])
        sched.update(out, sampled, forks)
        check_blocks(sched)
    check_drained(sched)
    if sched.stats.prefix_cache_hits:
        event("prefix cache hit")
    for seq in all_seqs:
        event(f"finish_reason={seq.finish_reason}")
        assert seq.is_finished
        if seq.finish_reason == "abort":
            continue
        # Whatever the scheduling, each output continues its context exactly.
        start = seq.num_prompt_tokens + (seq.seq_id in children)
        tokens = seq.token_ids
        for pos in range(start, seq.num_tokens):
            assert tokens[pos] == next_token(tokens[:pos])
        params = seq.sampling_params
        if seq.finish_reason == "length":
            assert seq.num_tokens == max_model_len or seq.num_output_tokens == params.max_tokens
        else:
            assert seq.last_token_id == eos


# --- images computed whole -----------------------------------------------------------------------


def _with_images(seq: Sequence, *spans: tuple[int, int], bidirectional: bool = True) -> Sequence:
    """`seq` whose prompt holds images at the (offset, length) `spans`."""
    from dataclasses import replace

    from backend_lib.llm.core.multimodal import MultiModalFeature

    features = tuple(
        MultiModalFeature(bytes([i]) * 32, offset, length, {}, bidirectional)
        for i, (offset, length) in enumerate(spans)
    )
    seq.request = replace(seq.request, mm_features=features)
    return seq


def _chunk_ends(sched, runner, seq) -> list[int]:
    """Where each of `seq`'s chunks ends, stepping until its prompt is computed."""
    ends = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out, _ = step(sched, runner)
        ends += [seq.num_computed_tokens for i in out.scheduled if i.seq is seq]
    return ends


def test_a_chunk_never_ends_inside_an_image_attended_both_ways():
    # Budget 18 beside a running decode: the 60-token prompt's chunks end before each image
    # (at 10 and 30) and take it whole; a causal image is split as any text.
    sched = make_scheduler(max_num_batched_tokens=18, max_model_len=80)
    runner = FakeRunner(sched)
    short = make_seq(range(4), max_tokens=30)
    sched.add(short)
    step(sched, runner)
    both_ways = _with_images(make_seq(range(100, 160), max_tokens=2), (10, 14), (30, 16))
    sched.add(both_ways)
    assert _chunk_ends(sched, runner, both_ways) == [10, 27, 30, 47, 60]
    causal = _with_images(make_seq(range(200, 260), max_tokens=2), (10, 14), bidirectional=False)
    sched.add(causal)
    assert any(10 < end < 24 for end in _chunk_ends(sched, runner, causal))
    run(sched, runner)
    assert_reference_outputs([short, both_ways, causal])


def test_a_prefix_hit_inside_an_image_computes_the_rest_of_it_in_one_chunk():
    sched = make_scheduler(max_num_batched_tokens=18, max_model_len=80)
    runner = FakeRunner(sched)
    first = _with_images(make_seq(range(100, 134), max_tokens=1), (18, 16))
    sched.add(first)
    assert _chunk_ends(sched, runner, first) == [18, 34]
    run(sched, runner)
    again = _with_images(make_seq(range(100, 134), max_tokens=1), (18, 16))
    sched.add(again)
    assert _chunk_ends(sched, runner, again) == [34]
    assert again.num_cached_prompt_tokens == 32  # four full blocks: the hit ends in the image
    run(sched, runner)
    assert_reference_outputs([first, again])
