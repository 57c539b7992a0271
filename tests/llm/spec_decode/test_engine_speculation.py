"""Speculative decoding in the engine (`speculative_config`), n-gram prompt lookup and the shipped
draft model, on the Shakespeare model: greedy text and token ids equal plain decoding's (and
transformers' `generate` with prompt lookup or the assistant model) across the engine's features;
drafts are counted, accepted runs stop where plain decoding stops, and no KV block leaks."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaForCausalLM

from backend_lib.config import ConfigError
from backend_lib.llm.config import LLMConfig
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.engine_helpers import assert_pool_released, greedy
from tests.llm.shakespeare_helpers import SHAKESPEARE, SHAKESPEARE_DRAFT
from tests.llm.spec_decode.speculation_helpers import (
    DRAFT,
    METHODS,
    NGRAM,
    PROMPTS,
    SMALL_POOL,
    completions,
    engine,
)


@pytest.fixture(scope="module")
def plain() -> LLMEngine:
    return engine()


@pytest.fixture(scope="module", params=list(METHODS))
def method(request) -> dict:
    """The speculative_config of each method."""
    return METHODS[request.param]


@pytest.fixture(scope="module")
def speculating(method) -> LLMEngine:
    return engine(method)


def test_greedy_text_equals_plain_decoding_and_drafts_are_accepted(plain, speculating):
    params = greedy(60)
    before = speculating.stats().counters
    expected = plain.generate(PROMPTS, params)
    got = speculating.generate(PROMPTS, params)
    assert completions(got) == completions(expected)
    counters = speculating.stats().counters - before
    assert counters.spec_decode_num_drafts > 0
    assert 0 < counters.spec_decode_num_accepted_tokens <= counters.spec_decode_num_draft_tokens
    per_pos = counters.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == counters.spec_decode_num_accepted_tokens
    # A draft is accepted only after every draft before it.
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    # Fewer steps than tokens: every accepted draft saved one.
    assert counters.generation_tokens == sum(len(o.outputs[0].token_ids) for o in got)
    assert_pool_released(speculating)


def _hf(model_dir) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)


def test_equals_transformers_speculative_generate(method, speculating):
    """transformers' own speculative greedy search: prompt lookup for ngram, assisted generation
    with the same draft checkpoint for draft_model."""
    if method["method"] == "ngram":
        options = {
            "prompt_lookup_num_tokens": NGRAM["num_speculative_tokens"],
            "max_matching_ngram_size": NGRAM["prompt_lookup_max"],
        }
    else:
        options = {"assistant_model": _hf(SHAKESPEARE_DRAFT), "num_assistant_tokens": 4}
    ids = speculating.tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        reference = (
            _hf(SHAKESPEARE)
            .generate(
                torch.tensor([ids]),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **options,
            )[0, len(ids) :]
            .tolist()
        )
    (out,) = speculating.generate([ids], greedy(40))
    assert out.outputs[0].token_ids == reference


@pytest.mark.sample(4)
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"enable_chunked_prefill": True, "max_num_batched_tokens": 24}, id="chunked"),
        pytest.param({**SMALL_POOL, "preemption_mode": "recompute"}, id="recompute"),
        pytest.param({**SMALL_POOL, "preemption_mode": "swap", "swap_space": 1}, id="swap"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    ],
)
def test_greedy_equals_plain_under_engine_settings(plain, method, overrides):
    params = greedy(48)
    spec = engine(method, **overrides)
    expected = plain.generate(PROMPTS, params)
    got = spec.generate(PROMPTS, params)
    assert completions(got) == completions(expected)
    if "preemption_mode" in overrides:
        assert spec.stats().counters.num_preemptions > 0
    assert_pool_released(spec)


def test_prefix_hits_and_cached_blocks_hold_only_accepted_tokens(plain, speculating):
    """A second request sharing the first's prompt and output reads blocks the first cached while
    it speculated: the same text as plain decoding proves they hold the accepted tokens."""
    (first,) = speculating.generate([PROMPTS[0]], greedy(40))
    follow = first.prompt_token_ids + first.outputs[0].token_ids
    (again,) = speculating.generate([follow], greedy(24))
    assert again.num_cached_tokens > len(first.prompt_token_ids)
    (expected,) = plain.generate([follow], greedy(24))
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(plain, speculating):
    """Stop strings, stop ids and max_tokens met by a token inside an accepted run: the tokens
    after it are never emitted (text, ids, finish and stop reasons as plain decoding's)."""
    (reference,) = plain.generate([PROMPTS[0]], greedy(60))
    tokens = reference.outputs[0].token_ids
    text = reference.outputs[0].text
    cases = [
        greedy(60, stop=[text[25:31]]),
        greedy(60, stop=[text[40:44]], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[tokens[17]]),
        greedy(13),
    ]
    for params in cases:
        (expected,) = plain.generate([PROMPTS[0]], params)
        (got,) = speculating.generate([PROMPTS[0]], params)
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got.outputs] == [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in expected.outputs
        ], params
    assert_pool_released(speculating)


@pytest.mark.sample(1)
def test_logprobs_penalties_n_and_lora_rows(method):
    """Logprobs of emitted tokens, repetition penalties (the history includes earlier drafts),
    n > 1 (sampled) and LoRA rows beside base rows all match plain decoding."""
    with_lora = engine(None, lora=True)
    spec = engine(method, lora=True)
    cases = [
        (greedy(40, logprobs=3), None),
        (greedy(40, repetition_penalty=1.3, frequency_penalty=0.2), None),
        # n > 1 samples; top_k=1 makes each sample the argmax, so the rejection rule (accept a
        # draft with probability p(draft), else resample) must give plain decoding's tokens.
        (SamplingParams(temperature=1.0, top_k=1, max_tokens=30, n=2, ignore_eos=True), None),
        (greedy(40), "sonnets"),
    ]
    for params, lora in cases:
        names = [lora, None]
        expected = with_lora.generate(PROMPTS[:2], params, lora_names=names)
        got = spec.generate(PROMPTS[:2], params, lora_names=names)
        assert completions(got) == completions(expected), (params, lora)
        for e, g in zip(expected, got, strict=True):
            for ce, cg in zip(e.outputs, g.outputs, strict=True):
                if ce.logprobs is None:
                    assert cg.logprobs is None
                    continue
                assert [list(x) for x in cg.logprobs] == [list(x) for x in ce.logprobs]
                for xe, xg in zip(ce.logprobs, cg.logprobs, strict=True):
                    for token, lp in xe.items():
                        assert xg[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
                        assert xg[token].rank == lp.rank
    assert_pool_released(spec)


def test_seeded_sampling_is_reproducible_and_stays_in_the_vocabulary(speculating):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=11, ignore_eos=True)
    first = speculating.generate(PROMPTS[:2], params)
    second = speculating.generate(PROMPTS[:2], params)
    assert completions(first) == completions(second)
    vocab = speculating.vocab_size
    assert all(0 <= t < vocab for out in first for t in out.outputs[0].token_ids)
    assert all(len(out.outputs[0].token_ids) == 40 for out in first)
    assert_pool_released(speculating)


QUOTE = r"[A-Za-z ,.;:'\n-]{40,160}"
"""A regex the quoting prompt's answer fits: drafts copied from the prompt are allowed."""
CONSTRAINTS = [
    {"regex": "(the|a) [a-z]+ [a-z]+ [a-z]+"},
    {"regex": QUOTE},
    {"json": {"type": "object", "properties": {"l": {"type": "string"}}, "required": ["l"]}},
    {"choice": ["The little Love-god lying once asleep", "Shall I compare thee"]},
]


def test_structured_outputs_draft_within_the_grammar_and_match_plain(plain, speculating):
    """Drafts under a constraint are cut to what the grammar allows and each verified position
    is masked: greedy text equals plain decoding's, and drafts are still accepted."""
    before = speculating.stats().counters
    for constraint in CONSTRAINTS:
        params = greedy(48, structured_outputs=constraint)
        expected = plain.generate(PROMPTS[:2], params)
        got = speculating.generate(PROMPTS[:2], params)
        assert completions(got) == completions(expected), constraint
    counters = speculating.stats().counters - before
    assert counters.spec_decode_num_drafts > 0 and counters.spec_decode_num_accepted_tokens > 0
    assert len(speculating.structured) == 0
    assert_pool_released(speculating)


def test_sampled_structured_outputs_keep_to_the_grammar(speculating):
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=64, structured_outputs={"regex": QUOTE}
    )
    outs = speculating.generate(PROMPTS[:2] * 2, params)
    for out in outs:
        completion = out.outputs[0]
        assert out.error is None
        if completion.finish_reason == "stop":
            assert re.fullmatch(QUOTE, completion.text), completion.text
        else:
            assert re.fullmatch(r"[A-Za-z ,.;:'\n-]*", completion.text), completion.text
    assert completions(outs[:2]) == completions(outs[2:])  # seeded: reproducible
    assert_pool_released(speculating)


def test_speculation_is_off_above_the_batch_size_limit(plain):
    # prompt_lookup_min 1: a match (and so drafts) nearly every step while speculating.
    spec = engine({**NGRAM, "prompt_lookup_min": 1, "speculative_disable_by_batch_size": 2})
    params = greedy(30)
    got = spec.generate(PROMPTS, params)  # four running: never speculates
    assert spec.stats().counters.spec_decode_num_drafts == 0
    assert completions(got) == completions(plain.generate(PROMPTS, params))
    spec.generate(PROMPTS[:1], params)  # one running: speculates
    assert spec.stats().counters.spec_decode_num_drafts > 0


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ("{not json", "speculative_config"),
    ],
)
def test_a_bad_speculative_config_fails_validation_naming_the_field(value, field):
    text = value if isinstance(value, str) else json.dumps(value)
    config = LLMConfig(model=str(SHAKESPEARE), speculative_config=text)
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert field in str(error.value)


@pytest.mark.sample(2)
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("kind", list(METHODS))
def test_greedy_equals_plain_with_two_ranks(parallel, kind):
    """Rank 0 drafts (the draft model runs there alone, unsharded) and verifies; the other rank
    (a worker process: the other tensor-parallel shard, or the second pipeline stage) computes
    the drafted rows in the same forward."""
    from tests.llm.engine_helpers import engine_checkpoint, make_engine, random_prompt

    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    prompts = [random_prompt(6, 0) * 4, random_prompt(5, 1) * 3 + random_prompt(4, 2)]
    speculative = json.dumps(
        {**NGRAM, "prompt_lookup_min": 1}
        if kind == "ngram"
        else {**DRAFT, "model": str(model_dir)}  # the target itself as its draft
    )
    expected = make_engine(model_dir).generate(prompts, greedy(24))
    spec = make_engine(model_dir, speculative_config=speculative, **{parallel: 2})
    try:
        got = spec.generate(prompts, greedy(24))
        assert spec.stats().counters.spec_decode_num_drafts > 0
    finally:
        spec.close()
    assert completions(got) == completions(expected)
