"""Multi-LoRA scheduling and caching: at most max_loras adapters per step with first-come
first-served waiting (no overtaking, outputs still exact), LRU replacement in the device slots,
no prefix-cache hit across adapters (checked through the prefix-cache counters), and per-request
errors that leave the other requests running."""

from __future__ import annotations

import pytest

from backend_lib.errors import InputError
from backend_lib.llm.lora.registry import LORA_DISABLED_ERROR
from backend_lib.llm.lora.slots import LoRASlots
from tests.llm.engine_helpers import assert_pool_released, greedy, make_engine, random_prompt
from tests.llm.lora_helpers import lora_checkpoint, make_lora_engine
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _engine(**overrides):
    model_dir, hf, adapters = lora_checkpoint("LlamaForCausalLM")
    modules = {name: path for name, (path, _) in adapters.items()}
    references = {None: hf} | {name: peft for name, (_, peft) in adapters.items()}
    return make_lora_engine(model_dir, modules, **overrides), references


def test_no_prefix_hit_across_adapters():
    engine, _ = _engine()
    prompt = random_prompt(25, 1)  # three full blocks of 8 can be cached

    def run(name):
        before = engine.stats().counters
        (out,) = engine.generate([prompt], greedy(3), lora_names=[name])
        after = engine.stats().counters
        return after.prefix_cache_hits - before.prefix_cache_hits, out.num_cached_tokens

    assert run("r4") == (0, 0)
    assert run("r16") == (0, 0)  # the same tokens, cached under r4: no hit
    assert run(None) == (0, 0)  # nor for the base model
    assert run("r4") == (24, 24)  # its own adapter's blocks: a hit
    assert run(None) == (24, 24)
    assert_pool_released(engine)


def test_at_most_max_loras_adapters_per_step_first_come_first_served():
    engine, references = _engine(max_loras=1)
    order: list[str] = []
    steps: list[set[int]] = []
    execute = engine.runner.execute

    def recording(out, *args):
        steps.append({item.seq.lora_int_id for item in out.scheduled} - {0})
        for item in out.scheduled:
            if item.seq.request_id not in order:
                order.append(item.seq.request_id)
        return execute(out, *args)

    engine.runner.execute = recording
    names = ["r4", "r16", None, "r4", "r8-rslora", None]
    prompts = [random_prompt(6 + i, 10 + i) for i in range(len(names))]
    outs = engine.generate(prompts, greedy(6), lora_names=names)
    assert max(len(step) for step in steps) == 1
    # generate-<i> in submission order: nothing overtakes a request waiting for its adapter
    # (the second r4 request waits behind r16's although r4 is resident).
    assert order == sorted(order, key=lambda r: int(r.split("-")[1]))
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(references[name], prompt, 6)
    slots = engine.runner.lora_slots
    assert slots.num_loads == 4  # r4, r16, r4 again (evicted by r16), r8-rslora
    assert_pool_released(engine)


def test_slots_replace_the_least_recently_used_adapter():
    engine, _ = _engine(max_loras=2)
    registry, slots = engine.lora_registry, engine.runner.lora_slots
    r4, r8, r16 = (registry.request(n) for n in ("r4", "r8-rslora", "r16"))
    assert slots.activate([r4]) == {1: 0}
    assert slots.activate([r8]) == {2: 1}
    assert slots.activate([r4, r4]) == {1: 0}  # r4 used again: r8 is now the LRU one
    assert slots.activate([r16]) == {3: 1}  # r16 takes r8's slot
    assert slots.resident_ids == [1, 3]
    assert slots.activate([r8, r16]) == {2: 0, 3: 1}  # r16 needed: r4 goes
    assert slots.num_loads == 4
    with pytest.raises(ValueError, match="3 adapters in one step, only 2 slots"):
        slots.activate([r4, r8, r16])
    assert isinstance(slots, LoRASlots)


def test_bad_lora_requests_fail_alone():
    engine, references = _engine(max_lora_rank=8)
    good = random_prompt(9, 3)
    engine.add_request("base", None, greedy(5), prompt_token_ids=good)
    engine.add_request("r4", None, greedy(5), prompt_token_ids=good, lora_name="r4")
    with pytest.raises(InputError, match=r"LoRA nope is not supported, we currently support \["):
        engine.add_request("x", None, greedy(5), prompt_token_ids=good, lora_name="nope")
    with pytest.raises(InputError, match="rank 16 .* exceeds max_lora_rank=8"):
        engine.add_request("y", None, greedy(5), prompt_token_ids=good, lora_name="r16")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["base"].outputs[0].token_ids == hf_greedy(references[None], good, 5)
    assert finals["r4"].outputs[0].token_ids == hf_greedy(references["r4"], good, 5)
    assert_pool_released(engine)


def test_lora_name_without_enable_lora_is_the_vllm_error():
    model_dir, _, _ = lora_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    with pytest.raises(InputError) as info:
        engine.add_request("x", None, greedy(2), prompt_token_ids=[5, 6], lora_name="r4")
    assert str(info.value) == LORA_DISABLED_ERROR == "LoRA feature is not enabled."
