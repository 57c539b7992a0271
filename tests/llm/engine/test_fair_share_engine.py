"""Fair share and the per-tenant limits in the engine: a request's `tenant` reaches the
scheduler (else its adapter's, else "default"), a weights file is read at load (a bad one fails
the load, naming `tenant_weights`), a tenant past `max_queued_per_tenant` is refused alone, and
fair share changes only the order: under tenants, weights, displacement and preemption every
greedy output is still transformers' own, and the stats count tokens per tenant."""

from __future__ import annotations

import json

import pytest

from backend_lib.config import ConfigError
from backend_lib.contract import ErrorCode
from backend_lib.errors import InputError, TenantLimitError, error_code
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.engine_helpers import (
    assert_pool_released,
    engine_checkpoint,
    greedy,
    llm_config,
    make_engine,
    random_prompt,
    run_in_two_waves,
)
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_greedy_outputs_are_transformers_under_fair_share_and_displacement(policy, tmp_path):
    """Three slots and 10 blocks for nine requests of three tenants (weights 2:1:1), a flood
    first, the others arriving after: tenants displace the flood's newest and blocks run out, and
    every output is still `generate`'s."""
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"gold": 2}))
    engine = LLMEngine(
        llm_config(
            model_dir,
            fair_share=True,
            tenant_weights=str(weights),
            scheduling_policy=policy,
            max_num_seqs=3,
            max_model_len=64,
            num_blocks=10,
        ),
        model_dir,
        "cpu",
    )
    prompts = [random_prompt(6 + 3 * (k % 4), 200 + k) for k in range(9)]
    tenants = ["flood"] * 5 + ["gold", "chat", "gold", "chat"]
    requests = [
        EngineRequest(f"r{k}", None, greedy(14), prompt, tenant=tenant)
        for k, (prompt, tenant) in enumerate(zip(prompts, tenants, strict=True))
    ]
    outputs = run_in_two_waves(engine, requests, first=5)
    assert engine.scheduler.num_preemptions > 0
    served = engine.stats().tokens_by_tenant  # since the engine started: the first snapshot
    for k, prompt in enumerate(prompts):
        assert outputs[f"r{k}"].outputs[0].token_ids == hf_greedy(hf, prompt, 14), k
    assert_pool_released(engine)
    expected = {t: 0 for t in tenants}
    for k, tenant in enumerate(tenants):
        expected[tenant] += len(prompts[k]) + 13  # every position computed once, no cache hit
    assert set(served) == set(expected)
    assert all(served[t] >= expected[t] for t in expected)  # recomputation counts again


def test_a_tenant_past_max_queued_per_tenant_is_refused_alone():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_queued_per_tenant=2, max_num_seqs=1)
    for k in range(2):
        engine.add(EngineRequest(f"a{k}", None, greedy(2), random_prompt(4, k), tenant="a"))
    with pytest.raises(TenantLimitError, match="tenant 'a' has 2 requests waiting") as caught:
        engine.add(EngineRequest("a2", None, greedy(2), random_prompt(4, 9), tenant="a"))
    assert error_code(caught.value) is ErrorCode.QUEUE_FULL  # HTTP 429 at the frontend
    engine.add(EngineRequest("b0", None, greedy(2), random_prompt(4, 7), tenant="b"))
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_released(engine)


@pytest.mark.parametrize("tenant", ["", 7, "x" * 257])
def test_a_bad_tenant_is_an_input_error(tenant):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    request = EngineRequest("r", None, greedy(2), random_prompt(4, 1), tenant=tenant)
    with pytest.raises(InputError, match="tenant must be a non-empty string"):
        engine.add(request)
    assert not engine.has_unfinished_requests()


def test_a_bad_weights_file_fails_the_load_naming_the_field(tmp_path):
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    bad = tmp_path / "weights.json"
    bad.write_text('{"gold": -1}')
    config = llm_config(model_dir, fair_share=True, tenant_weights=str(bad))
    with pytest.raises(ConfigError, match="tenant_weights") as caught:
        LLMEngine(config, model_dir, "cpu")
    assert caught.value.key == "tenant_weights"
