"""Prompt logprobs and token-id prompts through the `openai` SDK (`/v1/completions` with `echo`) and
through Triton's `sampling_parameters`, against transformers' log-softmax on the same checkpoint:
in one prefill chunk, chunked (a server whose step budget is 32 tokens), and with the prompt's
prefix already in the prefix cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from tests.e2e.llm_client import grpc_stream
from tests.openai.frontend_helpers import start_frontend, stop_frontend
from tests.openai.references import llm_generate
from tests.server_helpers import start_server, stop_server
from tooling.repository import REPO_ROOT, ModelSpec, write_model

pytestmark = pytest.mark.e2e
SHAKESPEARE = REPO_ROOT / "models" / "shakespeare-llama"
PROMPT = (
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name; "
    "or, if thou wilt not, be but sworn my love, and I'll no longer be a Capulet."
)
TOLERANCE = 2e-3
TOP = 3


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(SHAKESPEARE)


@pytest.fixture(scope="module")
def reference(tokenizer) -> tuple[list[int], torch.Tensor]:
    """(the prompt's token ids, transformers' float32 log-softmax at each position)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(SHAKESPEARE, dtype=torch.float32)
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def chunking_server(tmp_path_factory):
    """An llm whose steps take at most 32 tokens: the prompt is prefilled in several chunks."""
    repository = tmp_path_factory.mktemp("chunked-repo")
    parameters = {
        "model": str(SHAKESPEARE),
        "dtype": "float32",
        "max_model_len": "256",
        "max_num_batched_tokens": "32",
        "cpu_kv_cache_gb": "0.05",
        "max_num_seqs": "4",
    }
    write_model(ModelSpec("llm", "llm", parameters, max_batch_size=0), repository)
    server = start_server(repository)
    yield server, repository
    stop_server(server)


@pytest.fixture(scope="module")
def chunking_sdk(chunking_server, make_frontend_module) -> openai.OpenAI:
    server, repository = chunking_server
    front = make_frontend_module(server.grpc_url, repository)
    return openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def make_frontend_module() -> Iterator:
    started = []

    def factory(triton_url: str, repository: Path):
        front = start_frontend(triton_url, repository)
        started.append(front)
        return front

    yield factory
    for front in started:
        stop_frontend(front)


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def check_prompt_logprobs(logprobs, ids, log_softmax, tokenizer) -> None:
    """OpenAI's legacy logprobs of an echoed prompt: every token, the first without a logprob."""
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = log_softmax[i - 1]
        assert logprobs.token_logprobs[i] == pytest.approx(row[ids[i]].item(), abs=TOLERANCE)
        top = row.topk(TOP)
        assert sorted(logprobs.top_logprobs[i].values(), reverse=True) == pytest.approx(
            top.values.tolist(), abs=TOLERANCE
        )
        assert set(logprobs.top_logprobs[i]) == {tokenizer.decode([t]) for t in top.indices}


@pytest.mark.parametrize("deployment", ["default", "chunked"])
def test_echoed_prompt_logprobs_equal_transformers(deployment, request, reference, tokenizer, sdk):
    client = sdk if deployment == "default" else request.getfixturevalue("chunking_sdk")
    ids, log_softmax = reference
    reply = client.completions.create(
        model="llm", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=0
    )
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    check_prompt_logprobs(choice.logprobs, ids, log_softmax, tokenizer)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_a_cached_prefix_drops_no_position(reference, tokenizer, sdk):
    ids, log_softmax = reference
    for _ in range(2):  # the second request is served from the prefix cache
        sdk.completions.create(model="llm", prompt=PROMPT, max_tokens=1, temperature=0)
    reply = sdk.completions.create(
        model="llm", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=0
    )
    check_prompt_logprobs(reply.choices[0].logprobs, ids, log_softmax, tokenizer)


def test_echo_with_generation_lists_prompt_then_output(reference, tokenizer, sdk, server):
    ids, log_softmax = reference
    expected, _ = llm_generate(server, PROMPT, {"temperature": 0, "max_tokens": 4})
    reply = sdk.completions.create(
        model="llm", prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=4, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text == PROMPT + expected[0]
    assert len(choice.logprobs.tokens) == len(ids) + 4
    assert "".join(choice.logprobs.tokens[len(ids) :]) == expected[0]
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])


def test_prompt_logprobs_through_sampling_parameters(reference, tokenizer, chunking_server):
    server, _ = chunking_server
    ids, log_softmax = reference
    params = {"temperature": 0, "max_tokens": 1, "prompt_logprobs": TOP}
    result = grpc_stream(server.grpc_url, PROMPT, params)
    assert result.error is None, result.error
    carrying = [r["prompt_logprobs"] for r in result.responses if "prompt_logprobs" in r]
    assert len(carrying) == 1  # once, in the first response after the prefill
    positions = json.loads(carrying[0][0])
    assert len(positions) == len(ids)
    for i, position in enumerate(positions):
        token, entry = next(iter(position.items()))  # the prompt token first
        assert int(token) == ids[i] and entry["decoded_token"] == tokenizer.decode([ids[i]])
        if i == 0:
            assert entry["logprob"] is None and entry["rank"] is None
            continue
        row = log_softmax[i - 1]
        assert entry["logprob"] == pytest.approx(row[ids[i]].item(), abs=TOLERANCE)
        assert entry["rank"] == int((row > row[ids[i]]).sum()) + 1


def test_a_token_id_prompt_answers_like_its_text(tokenizer, sdk):
    greedy = {"temperature": 0, "max_tokens": 12}
    as_text = sdk.completions.create(model="llm", prompt=PROMPT, **greedy)
    ids = tokenizer(PROMPT).input_ids
    as_ids = sdk.completions.create(model="llm", prompt=ids, **greedy)
    assert as_ids.choices[0].text == as_text.choices[0].text
    # The same prompt twice: only the cached-token count may differ (the second reads the first's).
    same = {"prompt_tokens_details"}
    assert as_ids.usage.model_dump(exclude=same) == as_text.usage.model_dump(exclude=same)
    both = sdk.completions.create(model="llm", prompt=[ids, ids[:8]], echo=True, **greedy)
    assert both.choices[0].text == tokenizer.decode(ids) + as_text.choices[0].text
    assert len(both.choices) == 2


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": [1, 5, 99999]}, None, "prompt_token_ids must hold token ids in [0, 4096)"),
        ({"prompt": [1, -5]}, "prompt", ""),
        ({"prompt": []}, "prompt", ""),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs", ""),
    ],
)
def test_bad_prompts_and_budgets_are_400(client: httpx.Client, body, param, needle):
    reply = client.post("/v1/completions", json={"model": "llm", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert needle in error["message"]
    if param is not None:  # a union's validation error names the member too ("prompt.str")
        assert error["param"].split(".")[0] == param
    good = client.post(
        "/v1/completions", json={"model": "llm", "prompt": "ROMEO:", "max_tokens": 2}
    )
    assert good.status_code == 200
