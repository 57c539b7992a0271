"""Structured outputs in the engine: greedy outputs under JSON schemas, regexes, choices and
grammars equal transformers `generate` under xgrammar's own Hugging Face logits processor (token
for token), in batches mixed with unconstrained requests, under prefix-cache hits, chunked prefill
and preemption (recompute, swap); seeded sampling over a schema corpus validates; n > 1 children
keep their own matcher; grammar termination, dead ends and metrics."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from backend_lib.llm.core.sampling_params import SamplingParams
from tests.llm.engine_helpers import assert_pool_released, make_engine
from tests.llm.structured.structured_helpers import (
    CHOICES,
    CONSTRAINTS,
    REGEX,
    byte_level_checkpoint,
    reference_compiler,
)
from tooling.hf_reference import hf_greedy, hf_greedy_constrained
from tooling.json_schemas import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.usefixtures("single_torch_thread")

EOS = 2
NUM_TOKENS = 20
PROMPTS = [
    "ROMEO:\nWhat say you? Speak",
    "JULIET:\nO gentle",
    "Give me thy hand",
    "KING:",
    "First Citizen:\nBefore we proceed any further, hear me",
    "Tell me the name",
]
SCENARIOS = {
    "batch": {},
    "chunked": {"max_num_batched_tokens": 8},
    "recompute": {"num_blocks": 7, "max_model_len": 48, "max_num_batched_tokens": 48},
    "swap": {
        "num_blocks": 7,
        "max_model_len": 48,
        "max_num_batched_tokens": 48,
        "preemption_mode": "swap",
        "swap_space": 0.001,
    },
}


def _mixed_batch(compiler) -> tuple[list[SamplingParams | None], list[object | None]]:
    """Every constraint kind plus unconstrained requests (None grammar), one per prompt."""
    names = ["json", "regex", None, "choice", "json_compact", "grammar"]
    params, grammars = [], []
    for name in names:
        if name is None:
            params.append(SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
            grammars.append(None)
        else:
            so, compile_ = CONSTRAINTS[name]
            params.append(
                SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, structured_outputs=so)
            )
            grammars.append(compile_(compiler))
    return params, grammars


def _reference(hf, prompt_ids: list[int], grammar) -> list[int]:
    if grammar is None:
        return hf_greedy(hf, prompt_ids, NUM_TOKENS)
    return hf_greedy_constrained(hf, prompt_ids, grammar, NUM_TOKENS, EOS)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_default_model_matches_transformers_with_xgrammar(scenario):
    model_dir, hf = byte_level_checkpoint("shakespeare")
    engine = make_engine(
        model_dir, **{"max_model_len": 64, "num_blocks": 64, **SCENARIOS[scenario]}
    )
    params, grammars = _mixed_batch(reference_compiler(model_dir, hf.config.vocab_size))
    outs = engine.generate(PROMPTS, params)
    for out, grammar in zip(outs, grammars, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == _reference(hf, out.prompt_token_ids, grammar)
        assert out.error is None
        if grammar is not None and completion.finish_reason == "stop":
            assert completion.token_ids[-1] == EOS  # EOS only where the grammar could end
    by_kind = dict(
        zip(["json", "regex", "plain", "choice", "compact", "grammar"], outs, strict=True)
    )
    assert re.fullmatch(REGEX, by_kind["regex"].outputs[0].text)
    assert by_kind["choice"].outputs[0].text in CHOICES
    if scenario in ("recompute", "swap"):
        assert engine.stats().counters.num_preemptions > 0
    assert len(engine.structured) == 0
    assert_pool_released(engine)


def test_prefix_cache_hits_keep_constraints_exact():
    model_dir, hf = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    compiler = reference_compiler(model_dir, hf.config.vocab_size)
    shared = "First Citizen:\nBefore we proceed any further, hear me speak."
    engine.generate([shared + " All:"], SamplingParams(temperature=0.0, max_tokens=4))
    so, compile_ = CONSTRAINTS["json_compact"]
    prompts = [shared + " All:", shared + " Second"]
    outs = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, structured_outputs=so)
    )
    assert all(out.num_cached_tokens >= 8 for out in outs)
    for out in outs:
        assert out.outputs[0].token_ids == _reference(hf, out.prompt_token_ids, compile_(compiler))
    assert_pool_released(engine)


@pytest.mark.parametrize("name", ["random-llama", "qwen2"])
def test_test_built_checkpoints_match_transformers_with_xgrammar(name):
    model_dir, hf = byte_level_checkpoint(name)
    engine = make_engine(model_dir, max_model_len=64, max_num_batched_tokens=16)  # chunked
    params, grammars = _mixed_batch(reference_compiler(model_dir, hf.config.vocab_size))
    outs = engine.generate(PROMPTS, params)
    for out, grammar in zip(outs, grammars, strict=True):
        assert out.outputs[0].token_ids == _reference(hf, out.prompt_token_ids, grammar)
    assert_pool_released(engine)


def test_seeded_sampling_over_schema_corpus_validates():
    assert len(SCHEMAS) >= 30
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir, max_model_len=256, num_blocks=512, max_num_seqs=64)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            structured_outputs={"json": schema, "disable_any_whitespace": True},
        )
        for seed, schema in enumerate(SCHEMAS)
    ]
    outs = engine.generate(["Give me JSON:"] * len(SCHEMAS), params)
    stopped = 0
    for schema, out in zip(SCHEMAS, outs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length") and out.error is None
        if completion.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(
                json.loads(completion.text), schema, format_checker=jsonschema.FormatChecker()
            )
    assert stopped >= len(SCHEMAS) / 2
    assert_pool_released(engine)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_sampled_regex_and_choice_outputs_obey(temperature):
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir, max_model_len=96, num_blocks=256, max_num_seqs=32)
    params = [
        SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=40,
            structured_outputs={"regex": REGEX} if seed % 2 else {"choice": CHOICES},
        )
        for seed in range(16)
    ]
    outs = engine.generate(PROMPTS[:2] * 8, params)
    for seed, out in enumerate(outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        if seed % 2:
            assert re.fullmatch(REGEX, completion.text)
        else:
            assert completion.text in CHOICES
    assert_pool_released(engine)


def test_parallel_sampling_children_keep_their_own_matchers():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir, max_model_len=96, num_blocks=128)
    so = {"json": {"type": "array", "items": {"enum": ["ay", "nay"]}, "maxItems": 4}}
    params = SamplingParams(n=4, temperature=1.2, seed=7, max_tokens=40, structured_outputs={**so})
    (out,) = engine.generate(["ROMEO:"], params)
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1  # the children really diverged
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        value = json.loads(completion.text)
        assert len(value) <= 4 and set(value) <= {"ay", "nay"}
    assert len(engine.structured) == 0
    assert_pool_released(engine)


def test_terminated_grammar_finishes_with_stop_even_when_ignoring_eos():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, structured_outputs={"choice": CHOICES}
    )
    (out,) = engine.generate(["KING:"], params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.text in CHOICES
    assert completion.token_ids[-1] == EOS and len(completion.token_ids) < 30
    assert_pool_released(engine)


def test_streamed_text_deltas_add_up_to_the_constrained_text():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    so, _ = CONSTRAINTS["json_compact"]
    engine.add_request(
        "r", "KING:", SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    )
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert "".join(deltas) == final.outputs[0].text and final.outputs[0].text.startswith("{")


def test_dead_end_fails_only_that_request():
    # The tiny test tokenizer has no "{" token: the regex leaves no allowed first token.
    from tests.llm.engine_helpers import engine_checkpoint

    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    engine = make_engine(model_dir)
    engine.add_request(
        "dead", "ka ro", SamplingParams(max_tokens=8, structured_outputs={"regex": r"\{a\}"})
    )
    engine.add_request(
        "ok", "ka ro", SamplingParams(max_tokens=8, structured_outputs={"choice": ["kami", "te"]})
    )
    engine.add_request("plain", "ka ro", SamplingParams(temperature=0, max_tokens=5))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["dead"].outputs[0].finish_reason == "error"
    assert "dead end" in finals["dead"].error
    assert finals["ok"].error is None and finals["ok"].outputs[0].text in ("kami", "te")
    assert finals["plain"].error is None and len(finals["plain"].outputs[0].token_ids) == 5
    assert_pool_released(engine)
    assert len(engine.structured) == 0


def test_min_tokens_past_the_grammar_end_is_an_error_for_that_request():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    bad = SamplingParams(
        temperature=0, max_tokens=20, min_tokens=15, structured_outputs={"choice": ["ay"]}
    )
    good = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": CHOICES})
    bad_out, good_out = engine.generate(["KING:", "KING:"], [bad, good])
    assert bad_out.outputs[0].finish_reason == "error" and "structured_outputs" in bad_out.error
    assert good_out.error is None and good_out.outputs[0].text in CHOICES
    assert_pool_released(engine)


def test_bitmask_is_filled_on_a_worker_thread_during_the_step_and_only_when_constrained():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    manager = engine.structured
    threads = []
    fill = manager._fill
    manager._fill = lambda rows: threads.append(threading.current_thread().name) or fill(rows)
    engine.generate(["KING:"], SamplingParams(temperature=0, max_tokens=5))
    assert threads == [] and manager._executor is None  # unconstrained: no work, no thread
    engine.generate(
        ["KING:"], SamplingParams(temperature=0, structured_outputs={"choice": CHOICES})
    )
    assert threads and all(name.startswith("grammar-bitmask") for name in threads)


def test_structured_metrics_are_counted():
    model_dir, _ = byte_level_checkpoint("shakespeare")
    engine = make_engine(model_dir)
    engine.stats()
    so = {"regex": "[a-z]{3}"}
    engine.generate(
        ["KING:"] * 2, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so)
    )
    stats = engine.stats()
    assert stats.counters.structured_output_requests == 2
    assert len(stats.grammar_compile_seconds) == 1  # the second request hit the cache
    assert stats.bitmask_fill_seconds and all(s >= 0 for s in stats.bitmask_fill_seconds)
