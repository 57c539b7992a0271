"""Fair share between tenants and the per-tenant limits (core/tenants.py) on the fake runner of
scheduler_helpers.py: admission rotating by weighted tokens served, a tenant under its share of
slots displacing a flood's newest sequence (and no back-and-forth between tenants at their
share), a new tenant's prompt going before a flood's running chunked prefill, idle time earning
no credit, `max_running_per_tenant` and `max_queued_per_tenant`, and
outputs that stay exact whatever the order."""

from __future__ import annotations

import json

import pytest

from backend_lib.config import ConfigError, from_parameters
from backend_lib.errors import QueueFullError, TenantLimitError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.tenants import read_tenant_weights
from tests.llm.core.scheduler_helpers import (
    FakeRunner,
    assert_reference_outputs,
    make_scheduler,
    make_seq,
    run,
    step,
)


def flood(tenant: str, count: int, start: int = 0, max_tokens: int = 8, **kwargs):
    return [
        make_seq(range(start + k, start + k + 6), tenant=tenant, max_tokens=max_tokens, **kwargs)
        for k in range(count)
    ]


def tokens_while_both_wait(sched, runner, tenants=("a", "b")) -> dict[str, int]:
    """Step while every tenant in `tenants` still has a sequence waiting; the tokens each got."""
    served = dict.fromkeys(tenants, 0)
    while all(sched.waiting.count(t) for t in tenants):
        out, _ = step(sched, runner)
        for item in out.scheduled:
            served[item.seq.tenant] += item.num_new_tokens
    return served


@pytest.mark.parametrize("weights", [{}, {"a": 3.0}])
def test_admission_gives_each_tenant_tokens_in_proportion_to_its_weight(weights):
    """Tenant a arrives first with 60 requests, b just after with 60: under fcfs b would wait for
    all of a's; under fair share each gets tokens in proportion to its weight while both wait."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=4, fair_share=True)
    sched.tenants.weights = weights
    runner = FakeRunner(sched)
    seqs = flood("a", 60) + flood("b", 60, start=100)
    for seq in seqs:
        sched.add(seq)
    served = tokens_while_both_wait(sched, runner)
    ratio = served["a"] / served["b"]
    assert ratio == pytest.approx(weights.get("a", 1.0), rel=0.25), served
    run(sched, runner)
    assert_reference_outputs(seqs)


def test_fcfs_serves_the_first_tenant_s_flood_first():
    """The contrast: without fair share, b's requests wait behind all of a's."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=4)
    runner = FakeRunner(sched)
    for seq in flood("a", 30) + flood("b", 30, start=100):
        sched.add(seq)
    served = {"a": 0, "b": 0}
    for _ in range(20):
        out, _ = step(sched, runner)
        for item in out.scheduled:
            served[item.seq.tenant] += item.num_new_tokens
    assert served["b"] == 0 and served["a"] > 0


@pytest.mark.parametrize("fair_share", [True, False])
def test_an_interactive_tenant_displaces_a_flood_holding_every_slot(fair_share):
    """A flood holds all 8 slots with long requests and 100 more queued; another tenant's short
    request is scheduled at the next step under fair share (the flood's newest preempted), and
    waits under fcfs."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, fair_share=fair_share)
    runner = FakeRunner(sched)
    batch = flood("batch", 108, max_tokens=40)
    for seq in batch:
        sched.add(seq)
    for _ in range(3):
        step(sched, runner)
    assert len(sched.running) == 8
    newest = sched.running[-1]
    chat = make_seq(range(500, 506), tenant="chat", max_tokens=4)
    sched.add(chat)
    out, _ = step(sched, runner)
    scheduled = {i.seq.seq_id for i in out.scheduled}
    if fair_share:
        assert chat.seq_id in scheduled
        assert [s.seq_id for s in out.preempted] == [newest.seq_id]
    else:
        assert chat.seq_id not in scheduled and not out.preempted
    run(sched, runner, max_steps=2000)
    assert_reference_outputs([*batch, chat])


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_new_tenant_s_prompt_goes_before_a_flood_s_running_chunked_prefill(fair_share):
    """A flood tenant runs a decode and a long prompt being prefilled in 16-token chunks, over its
    share of slots, when another tenant's short prompt arrives: under fair share the new prompt
    goes before the flood's chunk, which gets the budget left; without, the running prefill
    keeps the budget."""
    sched = make_scheduler(
        max_model_len=128,
        fair_share=fair_share,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=3,
    )
    runner = FakeRunner(sched)
    decode = make_seq(range(6), tenant="batch", max_tokens=20)
    prefill = make_seq(range(10, 110), tenant="batch", max_tokens=4)
    for seq in (decode, prefill):
        sched.add(seq)
    step(sched, runner)
    step(sched, runner)
    (user,) = flood("user", 1, start=200)
    sched.add(user)
    out, _ = step(sched, runner)
    chunks = [(i.seq.seq_id, i.num_new_tokens) for i in out.scheduled]
    if fair_share:
        assert chunks == [(decode.seq_id, 1), (user.seq_id, 6), (prefill.seq_id, 9)]
    else:
        assert chunks == [(decode.seq_id, 1), (prefill.seq_id, 15)]
    assert not out.preempted
    run(sched, runner)
    assert_reference_outputs([decode, prefill, user])


def test_tenants_at_their_share_never_preempt_each_other():
    """Two floods of equal weight: once each holds its half of the slots, no more preemptions,
    however long they run (a tenant at or under its share is never a victim)."""
    sched = make_scheduler(num_blocks=512, max_num_seqs=8, fair_share=True)
    runner = FakeRunner(sched)
    a = flood("a", 40, max_tokens=30)
    for seq in a:
        sched.add(seq)
    step(sched, runner)
    b = flood("b", 40, start=100, max_tokens=30)
    for seq in b:
        sched.add(seq)
    for _ in range(6):
        step(sched, runner)
    running = [s.tenant for s in sched.running]
    assert running.count("a") == running.count("b") == 4
    preemptions = sched.num_preemptions
    assert preemptions == 4  # a's newest four, one per step of b's admissions at most
    for _ in range(40):
        step(sched, runner)
    assert sched.num_preemptions == preemptions
    run(sched, runner, max_steps=3000)
    assert_reference_outputs([*a, *b])


def test_idle_time_earns_no_credit():
    """a runs alone for a while, then b arrives: b's virtual time starts at a's, so admissions
    then alternate instead of b taking every slot until it has caught up a's tokens."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=2, fair_share=True)
    runner = FakeRunner(sched)
    for seq in flood("a", 80):
        sched.add(seq)
    for _ in range(60):
        step(sched, runner)
    assert sched.tenants.vtime("a") >= 200
    for seq in flood("b", 40, start=200):
        sched.add(seq)
    assert sched.tenants.vtime("b") == pytest.approx(sched.tenants.vtime("a"), abs=20)
    served = tokens_while_both_wait(sched, runner)
    assert served["a"] == pytest.approx(served["b"], rel=0.3), served


def test_max_running_per_tenant_lets_other_tenants_past():
    sched = make_scheduler(num_blocks=256, max_num_seqs=6, max_running_per_tenant=2)
    runner = FakeRunner(sched)
    a = flood("a", 10)
    b = flood("b", 3, start=100)
    for seq in a + b:
        sched.add(seq)
    while sched.has_unfinished():
        step(sched, runner)
        running = [s.tenant for s in sched.running]
        assert running.count("a") <= 2 and running.count("b") <= 2
    assert_reference_outputs(a + b)


def test_max_queued_per_tenant_refuses_that_tenant_only():
    sched = make_scheduler(max_num_seqs=1, max_queued_per_tenant=3)
    for seq in flood("a", 3):
        sched.add(seq)
    with pytest.raises(TenantLimitError, match="tenant 'a' has 3 requests waiting") as caught:
        sched.add(flood("a", 1, start=50)[0])
    assert isinstance(caught.value, QueueFullError)  # queue_full: HTTP 429 at the frontend
    sched.add(flood("b", 1, start=60)[0])  # another tenant is still accepted
    assert len(sched.waiting) == 4


def test_the_tenant_is_the_request_s_else_its_adapter_s_else_default():
    from backend_lib.llm.core.request import EngineRequest
    from backend_lib.llm.core.sampling_params import SamplingParams

    params = SamplingParams()
    assert EngineRequest("r", "x", params, tenant="acme", lora_name="sql").tenant_key == "acme"
    assert EngineRequest("r", "x", params, lora_name="sql").tenant_key == "sql"
    assert EngineRequest("r", "x", params).tenant_key == "default"


def test_tenant_weights_file(tmp_path):
    good = tmp_path / "weights.json"
    good.write_text(json.dumps({"gold": 4, "free": 0.5}))
    assert read_tenant_weights(good) == {"gold": 4.0, "free": 0.5}
    for text, reason in [
        ("{not json", "cannot read it as JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"gold": 0}', "tenant 'gold': the weight must be a finite number > 0"),
        ('{"gold": "4"}', "the weight must be"),
        ('{"gold": true}', "the weight must be"),
    ]:
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match="tenant_weights") as caught:
            read_tenant_weights(bad)
        assert reason in str(caught.value)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_tenant_weights(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"tenant_weights": "w.json"}, "tenant_weights"),  # weights without fair_share
        ({"max_running_per_tenant": "-1"}, "max_running_per_tenant"),
        ({"max_queued_per_tenant": "-2"}, "max_queued_per_tenant"),
        ({"max_tenant_labels": "0"}, "max_tenant_labels"),
        ({"fair_share": "maybe"}, "fair_share"),
    ],
)
def test_bad_tenant_settings_name_their_field(params, field):
    with pytest.raises(ConfigError) as caught:
        from_parameters(LLMConfig, params)
    assert caught.value.key == field
