"""LLMEngine acceptance: outputs against `transformers` (generate, forward logits) on tiny
random-weight checkpoints, under every scheduling path (batching, prefix cache, chunked prefill,
preemption by recompute and swap, late arrivals), plus sampling, stops, aborts, failures, stats.
"""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from backend_lib.config import ConfigError
from backend_lib.errors import InputError, QueueFullError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.config_helpers import llm_config
from tests.llm.engine_helpers import (
    VOCAB,
    assert_pool_released,
    engine_checkpoint,
    greedy,
    make_engine,
    output_ids,
    random_prompt,
)
from tooling.checkpoints import ARCHITECTURES
from tooling.hf_reference import hf_greedy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# --- fidelity ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_matches_generate(arch):
    model_dir, hf = engine_checkpoint(arch)
    engine = make_engine(model_dir)
    texts = ["kari tomi, venlu sa!", "zu", "mizu karozuqu zumi expo gazu breshi breny milu ven"]
    prompts: list[str | list[int]] = [*texts, random_prompt(23, 1), random_prompt(4, 2)]
    outs = engine.generate(prompts, greedy(8))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    for prompt, out in zip(prompts, outs, strict=True):
        if isinstance(prompt, str):  # tokenized as HF does for this checkpoint, BOS included
            assert out.prompt == prompt
            assert out.prompt_token_ids == tokenizer(prompt).input_ids
            assert out.prompt_token_ids[0] == 1 and len(out.prompt_token_ids) >= 2
        (completion,) = out.outputs
        assert completion.token_ids == hf_greedy(hf, out.prompt_token_ids, 8)
        assert completion.finish_reason == "length" and out.finished and out.error is None
    assert_pool_released(engine)


def test_prefix_cache_hits_keep_outputs_exact():
    model_dir, hf = engine_checkpoint("Qwen2ForCausalLM")
    engine = make_engine(model_dir)
    shared = random_prompt(20, 3)  # two full blocks of 8 and a partial one
    first = [shared + random_prompt(5, 4), shared + random_prompt(2, 5)]
    second = [shared + random_prompt(9, 6), shared[:17], first[0]]
    engine.generate(first, greedy(6))
    hits_before = engine.stats().counters.prefix_cache_hits
    outs = engine.generate(second, greedy(6))
    assert engine.stats().counters.prefix_cache_hits > hits_before
    assert all(out.num_cached_tokens >= 16 for out in outs)
    for prompt, out in zip(second, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert_pool_released(engine)


def test_chunked_prefill_keeps_outputs_exact():
    model_dir, hf = engine_checkpoint("MistralForCausalLM")  # sliding window 7 < prompt lengths
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    chunks = []
    execute = engine.runner.execute
    engine.runner.execute = lambda out, *a: (
        chunks.extend(s.num_new_tokens for s in out.scheduled) or execute(out, *a)
    )
    prompts = [random_prompt(27, 7), random_prompt(12, 8), random_prompt(5, 9)]
    assert output_ids(engine, prompts, greedy(5)) == [hf_greedy(hf, p, 5) for p in prompts]
    assert max(chunks) <= 8 < 27  # the long prompts really were split
    assert_pool_released(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(mode):
    model_dir, hf = engine_checkpoint("Qwen3ForCausalLM")
    engine = make_engine(
        model_dir,
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        swap_space=0.001,
    )
    prompts = [random_prompt(n, 10 + n) for n in (19, 13, 22, 7, 16)]
    assert output_ids(engine, prompts, greedy(10)) == [hf_greedy(hf, p, 10) for p in prompts]
    assert engine.stats().counters.num_preemptions > 0
    assert_pool_released(engine)


def test_requests_arriving_between_steps_match_generate():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    prompts = {f"r{i}": random_prompt(3 + 5 * i, 20 + i) for i in range(5)}
    arrivals = {0: ["r0"], 1: ["r1", "r2"], 4: ["r3"], 6: ["r4"]}
    finals, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for request_id in arrivals.get(step, []):
            engine.add_request(request_id, None, greedy(7), prompt_token_ids=prompts[request_id])
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    for request_id, prompt in prompts.items():
        assert finals[request_id].outputs[0].token_ids == hf_greedy(hf, prompt, 7)
    assert_pool_released(engine)


# --- sampling and logprobs ---------------------------------------------------------------------


def test_seeded_sampling_is_independent_of_batch_and_run():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    seeded = SamplingParams(temperature=1.2, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = random_prompt(9, 30)
    alone = output_ids(make_engine(model_dir), [prompt], seeded)[0]
    others = [random_prompt(14, 31), random_prompt(3, 32)]
    busy = make_engine(model_dir)
    outs = busy.generate(
        [others[0], prompt, others[1]],
        [SamplingParams(temperature=1.0, max_tokens=12), seeded, greedy(5)],
    )
    assert outs[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=1.2, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True
    )
    assert output_ids(busy, [prompt], other_seed)[0] != alone


def test_parallel_sampling_with_seed_is_reproducible_and_children_differ():
    model_dir, _ = engine_checkpoint("Qwen2ForCausalLM")
    # A high temperature: the tiny random model is very peaked.
    params = SamplingParams(
        n=4, temperature=4.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=1
    )
    prompt = random_prompt(10, 40)

    def run(extra: bool) -> list[list[int]]:
        engine = make_engine(model_dir)
        prompts = [prompt, random_prompt(5, 41)] if extra else [prompt]
        params_list = [params, SamplingParams(temperature=1.0, max_tokens=4)] if extra else [params]
        out = engine.generate(prompts, params_list)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 10 and len(c.logprobs) == 10 for c in out.outputs)
        assert_pool_released(engine)
        return [c.token_ids for c in out.outputs]

    first = run(extra=False)
    assert run(extra=True) == first
    assert len({tuple(ids) for ids in first}) == 4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_hf_log_softmax(temperature):
    model_dir, hf = engine_checkpoint("Qwen3ForCausalLM")
    engine = make_engine(model_dir)
    prompt = random_prompt(11, 50)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=8, ignore_eos=True, logprobs=3
    )
    (completion,) = engine.generate([prompt], params)[0].outputs
    full = prompt + completion.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([full])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        top = ref[j].topk(3)
        assert set(top.indices.tolist()) | {token} == set(entry)
        # The sampled token first (vLLM's order; the OpenAI frontend reads it from there), then
        # the top ones by rank.
        assert next(iter(entry)) == token
        others = [t for t in entry if t != token]
        assert others == [t for t in top.indices.tolist() if t != token]
        for token_id, logprob in entry.items():
            assert math.isclose(logprob.logprob, ref[j, token_id].item(), abs_tol=1e-4)
            assert logprob.rank == 1 + int((ref[j] > ref[j, token_id] + 1e-6).sum())
        total += ref[j, token].item()
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-3)


# --- stops, limits, aborts -----------------------------------------------------------------


def _stream(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """Run one request to completion; returns (outputs in order, final output)."""
    engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs, outs[-1]


def test_stop_string_is_cut_and_never_streamed():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    prompt = random_prompt(7, 60)
    _, plain = _stream(engine, "plain", prompt, greedy(20))
    text = plain.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    assert cut > 0
    for include in (False, True):
        params = greedy(20, stop=["@@never@@", stop], include_stop_str_in_output=include)
        outs, final = _stream(engine, f"stop-{include}", prompt, params)
        expected = text[: cut + len(stop)] if include else text[:cut]
        (completion,) = final.outputs
        assert completion.text == expected
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert plain.outputs[0].token_ids[: len(completion.token_ids)] == completion.token_ids
        streamed = ""
        for out in outs:
            streamed += out.outputs[0].delta_text
            assert expected.startswith(streamed)  # no part of a hidden stop string ever leaks
            assert out.outputs[0].text == streamed
        assert streamed == expected
    assert_pool_released(engine)


def test_stop_token_and_eos_hide_their_text():
    src_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(src_dir)
    prompt = random_prompt(6, 70)
    reference = output_ids(engine, [prompt], greedy(12))[0]
    j = 4
    stop_token = reference[j]
    first = reference.index(stop_token)  # the first occurrence is where it stops
    text_before = engine.generate([prompt], greedy(first))[0].outputs[0].text if first else ""
    text_with = engine.generate([prompt], greedy(first + 1))[0].outputs[0].text

    (c,) = engine.generate([prompt], greedy(12, stop_token_ids=[stop_token]))[0].outputs
    assert c.token_ids == reference[: first + 1] and c.text == text_before
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_token)
    (c,) = engine.generate(
        [prompt], greedy(12, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    )[0].outputs
    assert c.text == text_with

    # The same token as the checkpoint's EOS (generation_config.json): stop_reason None.
    eos_dir = Path(tempfile.mkdtemp(prefix="engine-eos-"))
    atexit.register(shutil.rmtree, eos_dir, ignore_errors=True)
    shutil.copytree(src_dir, eos_dir, dirs_exist_ok=True)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_token]}))
    eos_engine = make_engine(eos_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    (c,) = eos_engine.generate([prompt], params)[0].outputs
    assert c.token_ids == reference[: first + 1] and c.text == text_before
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    (c,) = eos_engine.generate([prompt], greedy(12))[0].outputs  # ignore_eos
    assert c.token_ids == reference and c.finish_reason == "length"


def test_min_tokens_defers_stop_tokens_like_hf():
    model_dir, hf = engine_checkpoint("Qwen2ForCausalLM")
    engine = make_engine(model_dir)
    prompt = random_prompt(8, 80)
    reference = hf_greedy(hf, prompt, 12)
    stop_token = reference[1]
    (c,) = engine.generate([prompt], greedy(12, stop_token_ids=[stop_token], min_tokens=6))[
        0
    ].outputs
    with torch.no_grad():  # HF: the stop token is banned until min_new_tokens, then ends generation
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            min_new_tokens=6,
            do_sample=False,
            eos_token_id=stop_token,
            pad_token_id=0,
        )[0, len(prompt) :]
    expected = ref.tolist()
    if stop_token in expected:
        expected = expected[: expected.index(stop_token) + 1]
    assert c.token_ids == expected
    assert stop_token not in c.token_ids[:6]
    assert c.finish_reason == ("stop" if c.token_ids[-1] == stop_token else "length")


def test_length_limits_and_prompt_too_long():
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_model_len=24, num_blocks=8)
    prompt = random_prompt(20, 90)
    for params in (greedy(None), greedy(100)):  # up to, and clamped to, max_model_len
        (c,) = engine.generate([prompt], params)[0].outputs
        assert c.token_ids == hf_greedy(hf, prompt, 4) and c.finish_reason == "length"
    (c,) = engine.generate([prompt], greedy(2))[0].outputs
    assert len(c.token_ids) == 2 and c.finish_reason == "length"
    with pytest.raises(InputError, match=r"24 tokens.*max_model_len is 24"):
        engine.add_request("long", None, greedy(1), prompt_token_ids=random_prompt(24, 91))
    assert_pool_released(engine)


def test_abort_frees_blocks_and_others_continue():
    model_dir, hf = engine_checkpoint("MistralForCausalLM")
    engine = make_engine(model_dir)
    prompts = {
        "keep": random_prompt(13, 100),
        "drop": random_prompt(17, 101),
        "queued": random_prompt(9, 102),
    }
    for request_id in ("keep", "drop"):
        engine.add_request(request_id, None, greedy(10), prompt_token_ids=prompts[request_id])
    for _ in range(3):
        engine.step()
    engine.add_request("queued", None, greedy(10), prompt_token_ids=prompts["queued"])
    for request_id in ("drop", "queued"):  # one running, one never scheduled
        out = engine.abort_request(request_id)
        assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort_request("drop") is None and engine.abort_request("unknown") is None
    assert len(out.outputs[0].token_ids) == 0
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(finals) == {"keep"}
    assert finals["keep"].outputs[0].token_ids == hf_greedy(hf, prompts["keep"], 10)
    assert_pool_released(engine)


# --- validation and failures -------------------------------------------------------------------


def test_bad_requests_raise_input_error_and_queue_limit():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir, max_queue_size=2)
    bad = [
        ("", {}),
        (None, {"prompt_token_ids": []}),
        (None, {"prompt_token_ids": [3, VOCAB]}),
        ("hi", {"params": SamplingParams(n=65, temperature=1.0)}),
        ("hi", {"params": SamplingParams(logprobs=21)}),
        ("hi", {"params": SamplingParams(stop_token_ids=[VOCAB + 1])}),
    ]
    for prompt, kwargs in bad:
        params = kwargs.pop("params", greedy(4))
        with pytest.raises(InputError):
            engine.add_request("bad", prompt, params, **kwargs)
    with pytest.raises(InputError):  # generate adds all prompts or none
        engine.generate(["ka", ""], greedy(2))
    assert not engine.has_unfinished_requests()
    engine.add_request("a", "ka", greedy(4))
    with pytest.raises(InputError, match="already"):
        engine.add_request("a", "ka", greedy(4))
    engine.add_request("b", "ka", greedy(4))
    with pytest.raises(QueueFullError):
        engine.add_request("c", "ka", greedy(4))
    finished = set()
    while engine.has_unfinished_requests():
        finished.update(o.request_id for o in engine.step() if o.finished)
    assert finished == {"a", "b"}
    assert_pool_released(engine)


def test_fault_in_one_request_fails_only_that_request():
    model_dir, hf = engine_checkpoint("Qwen3ForCausalLM")
    engine = make_engine(model_dir)
    calls = {"bad": 0}

    def injector(request_id: str) -> None:
        if request_id == "bad":
            calls["bad"] += 1
            if calls["bad"] == 3:
                raise RuntimeError("injected")

    engine.fault_injector = injector
    prompts = {"good": random_prompt(12, 110), "bad": random_prompt(12, 111)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, None, greedy(8), prompt_token_ids=prompt)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["bad"].error == "RuntimeError: injected"
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["good"].error is None
    assert finals["good"].outputs[0].token_ids == hf_greedy(hf, prompts["good"], 8)
    assert_pool_released(engine)


def test_forward_failure_fails_the_step_and_engine_recovers():
    model_dir, hf = engine_checkpoint("Qwen3ForCausalLM")
    engine = make_engine(model_dir)
    execute = engine.runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.add_request("a", None, greedy(5), prompt_token_ids=random_prompt(9, 120))
    engine.add_request("b", None, greedy(5), prompt_token_ids=random_prompt(30, 121))
    engine.step()
    engine.runner.execute = broken
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and o.error == "RuntimeError: device lost" for o in outs)
    assert_pool_released(engine)
    engine.runner.execute = execute
    prompt = random_prompt(15, 122)
    assert output_ids(engine, [prompt], greedy(6)) == [hf_greedy(hf, prompt, 6)]


# --- stats and construction --------------------------------------------------------------------


def test_stats_count_tokens_latencies_and_drain():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    before = engine.stats().counters
    prompts = [random_prompt(5, 130), random_prompt(9, 131)]
    engine.generate(
        prompts, [greedy(4), SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True)]
    )
    stats = engine.stats()
    delta = stats.counters - before
    assert delta.prompt_tokens == 14 and delta.generation_tokens == 4 + 2 * 3
    assert delta.requests_finished == 2 and delta.prefix_cache_queries == 14
    assert len(stats.time_to_first_token) == 2
    assert len(stats.inter_token_latency) == 3 + 2 * 2  # tokens after each sequence's first
    assert sorted(r.num_generation_tokens for r in stats.finished) == [4, 6]
    for record in stats.finished:
        assert 0 <= record.queue_time <= record.time_to_first_token <= record.e2e_latency
        assert record.decode_time >= 0 and record.finish_reason == "length"
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    drained = engine.stats()
    assert not drained.finished and not drained.time_to_first_token
    assert drained.counters == stats.counters


def test_from_config_resolves_relative_model_path(tmp_path):
    model_dir, hf = engine_checkpoint("LlamaForCausalLM")
    config = llm_config(Path(model_dir.name))
    engine = LLMEngine.from_config(config, model_dir.parent, torch.device("cpu"))
    prompt = random_prompt(6, 140)
    assert output_ids(engine, [prompt], greedy(3)) == [hf_greedy(hf, prompt, 3)]
    with pytest.raises(ConfigError, match="model"):
        LLMEngine.from_config(llm_config(Path("missing")), tmp_path, torch.device("cpu"))
