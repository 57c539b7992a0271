"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers' log-softmax on the Shakespeare
checkpoint: every prompt position, in one chunk and chunked, with a cached prefix present (such a
request reads none), after a recompute preemption, and beside requests that ask for none."""

from __future__ import annotations

import pytest
import torch
import transformers

from backend_lib.errors import InputError
from backend_lib.llm.core.sampling_params import SamplingParams
from backend_lib.llm.engine.llm_engine import LLMEngine
from tests.llm.config_helpers import llm_config
from tests.llm.engine_helpers import assert_pool_released
from tests.llm.shakespeare_helpers import SHAKESPEARE

TOLERANCE = 2e-3
PROMPT = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is "
    "the sun. Arise, fair sun, and kill the envious moon."
)
NUM_TOP = 5


@pytest.fixture(scope="module")
def hf_model() -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(SHAKESPEARE, dtype=torch.float32)
    return model.eval()


def engine(**overrides) -> LLMEngine:
    settings = {"num_blocks": 128, "max_model_len": 256, **overrides}
    return LLMEngine(llm_config(SHAKESPEARE, **settings), SHAKESPEARE, torch.device("cpu"))


def hf_log_softmax(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(prompt_logprobs, ids: list[int], reference: torch.Tensor) -> None:
    """Entry i scores ids[i] with the logits of position i - 1: its value, rank and top tokens."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        row = reference[i - 1]
        entry = prompt_logprobs[i]
        token = ids[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(NUM_TOP)
        by_rank = {e.rank: t for t, e in entry.items() if e.rank <= NUM_TOP}
        assert len(entry) - (token not in top.indices.tolist()) == NUM_TOP
        # Ties at this tolerance are absent on this checkpoint's prompts; ranks 1..k are its top-k.
        assert [by_rank[r] for r in range(1, NUM_TOP + 1)] == top.indices.tolist()
        for t, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[t].logprob == pytest.approx(value, abs=TOLERANCE)


def params(**kwargs) -> SamplingParams:
    settings = {"temperature": 0.0, "max_tokens": 4, "prompt_logprobs": NUM_TOP, **kwargs}
    return SamplingParams(**settings)


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-chunk", "chunked"])
def test_every_prompt_position_matches_transformers(hf_model, budget):
    llm = engine(max_num_batched_tokens=budget)
    out = llm.generate([PROMPT], params())[0]
    ids = out.prompt_token_ids
    assert len(ids) > 2 * 16  # several chunks of 16 in the chunked case
    check_against_hf(out.prompt_logprobs, ids, hf_log_softmax(hf_model, ids))
    assert_pool_released(llm)


def test_a_cached_prefix_is_not_read_and_no_position_is_dropped(hf_model):
    llm = engine()
    first = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))[0]
    again = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert first.prompt_logprobs is None and again.num_cached_tokens > 0  # the prefix is cached
    out = llm.generate([PROMPT], params())[0]
    assert out.num_cached_tokens == 0
    ids = out.prompt_token_ids
    check_against_hf(out.prompt_logprobs, ids, hf_log_softmax(hf_model, ids))
    assert out.outputs[0].token_ids[:2] == again.outputs[0].token_ids  # generation unchanged
    assert_pool_released(llm)


def test_recompute_preemption_scores_each_position_once(hf_model):
    # A pool of 12 blocks of 8 tokens cannot hold three ~45-token sequences growing by 40 tokens:
    # the youngest are preempted (recomputed) while the others decode.
    llm = engine(
        num_blocks=12, max_model_len=96, max_num_batched_tokens=64, preemption_mode="recompute"
    )
    prompts = [PROMPT, PROMPT.lower(), PROMPT[:60]]
    outs = llm.generate(prompts, params(ignore_eos=True, max_tokens=40))
    assert llm.stats().counters.num_preemptions > 0
    for out in outs:
        ids = out.prompt_token_ids
        check_against_hf(out.prompt_logprobs, ids, hf_log_softmax(hf_model, ids))
    assert_pool_released(llm)


def test_requests_without_prompt_logprobs_are_unaffected():
    llm = engine(max_num_batched_tokens=16)
    plain = SamplingParams(temperature=0.0, max_tokens=6)
    alone = llm.generate([PROMPT.upper()], plain)[0]
    mixed = llm.generate([PROMPT, PROMPT.upper()], [params(), plain])
    assert mixed[1].prompt_logprobs is None
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("value", [-1, 21, 1.5, "x"])
def test_bad_prompt_logprobs_is_an_input_error(value):
    with pytest.raises(InputError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": value}, max_logprobs=20)
