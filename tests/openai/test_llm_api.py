"""Chat and completions through the official `openai` SDK and langchain-openai, checked against
the llm model called directly."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from transformers import AutoTokenizer

from tests.openai.frontend_helpers import REPO_ROOT
from tests.openai.references import (
    CHAT_MESSAGES,
    SHAKESPEARE_CHAT,
    llm_generate,
    sse_events,
    wait_engine_idle,
)

pytestmark = pytest.mark.e2e
GREEDY = {"temperature": 0, "max_tokens": 24}
SHAKESPEARE_TOKENIZER = AutoTokenizer.from_pretrained(REPO_ROOT / "models" / "shakespeare-llama")


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


def test_chat_greedy_equals_the_model_on_the_rendered_prompt(sdk, server):
    expected, reasons = llm_generate(server, SHAKESPEARE_CHAT, GREEDY)
    reply = sdk.chat.completions.create(model="llm", messages=CHAT_MESSAGES, **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected[0]
    assert choice.finish_reason == reasons[0] == "length"
    assert reply.usage.completion_tokens == 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24
    tokens = httpx.post(
        f"{sdk.base_url}".replace("/v1/", "/tokenize"),
        json={"model": "llm", "prompt": SHAKESPEARE_CHAT},
    ).json()
    assert reply.usage.prompt_tokens == tokens["count"]


def test_chat_stream_joined_equals_non_streamed_async(frontend):
    async def run() -> tuple[str, str, list]:
        sdk = openai.AsyncOpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)
        whole = await sdk.chat.completions.create(
            model="llm", messages=CHAT_MESSAGES, max_completion_tokens=30, temperature=0
        )
        chunks = [
            chunk
            async for chunk in await sdk.chat.completions.create(
                model="llm",
                messages=CHAT_MESSAGES,
                max_completion_tokens=30,
                max_tokens=5,  # max_completion_tokens wins
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        await sdk.close()
        return whole.choices[0].message.content, whole.usage, chunks

    text, usage, chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == usage.model_dump()
    assert len(chunks) > 3  # one chunk per engine response


def test_seeded_sampling_is_reproducible_and_n_matches_the_model(sdk, server):
    params = {"temperature": 1.0, "seed": 7, "max_tokens": 16}
    vllm_fields = {"top_k": 50, "repetition_penalty": 1.1}  # not in the SDK's signature
    first, again = (
        sdk.chat.completions.create(
            model="llm", messages=CHAT_MESSAGES, n=3, extra_body=vllm_fields, **params
        )
        for _ in range(2)
    )
    expected, reasons = llm_generate(server, SHAKESPEARE_CHAT, {**params, **vllm_fields, "n": 3})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == expected
    assert [c.message.content for c in again.choices] == expected
    assert [c.finish_reason for c in first.choices] == reasons
    assert first.usage.completion_tokens == 48


def test_streamed_n_choices_carry_their_index(client, server):
    params = {"temperature": 0.9, "seed": 3, "max_tokens": 10, "n": 2}
    with client.stream(
        "POST",
        "/v1/completions",
        json={"model": "llm", "prompt": "JULIET:", "stream": True, **params},
    ) as response:
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    texts = ["", ""]
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == llm_generate(server, "JULIET:", params)[0]


def test_chat_logprobs_shape(sdk):
    reply = sdk.chat.completions.create(
        model="llm", messages=CHAT_MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 24
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled one is the top
        assert token.logprob <= 0 and token.bytes == list(token.token.encode())


def test_completions_prompts_echo_logprobs_and_stop(sdk, server):
    reply = sdk.completions.create(
        model="llm", prompt=["ROMEO:", "JULIET:"], echo=True, logprobs=2, **GREEDY
    )
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(["ROMEO:", "JULIET:"], reply.choices, strict=True):
        generated = llm_generate(server, prompt, GREEDY)[0][0]
        assert choice.text == prompt + generated
        # echo: the prompt's tokens first (BOS included; the first without a logprob), then
        # the 24 generated ones, offsets counted from the first token.
        logprobs = choice.logprobs
        num_prompt = len(SHAKESPEARE_TOKENIZER(prompt).input_ids)
        assert len(logprobs.tokens) == num_prompt + 24
        assert "".join(logprobs.tokens[num_prompt:]) == generated
        assert logprobs.text_offset[0] == 0
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    full = llm_generate(server, "ROMEO:", GREEDY)[0][0]
    stop = full.strip().split()[1]
    stopped = sdk.completions.create(model="llm", prompt="ROMEO:", stop=[stop], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]


def test_sync_completion_stream_equals_whole(sdk):
    whole = sdk.completions.create(model="llm", prompt="HAMLET:", **GREEDY).choices[0].text
    stream = sdk.completions.create(model="llm", prompt="HAMLET:", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole


def test_langchain_chat_invoke_and_stream(frontend):
    chat = ChatOpenAI(
        model="llm", base_url=frontend.base_url, api_key="unused", temperature=0, max_tokens=20
    )
    messages = [("system", "A street in Verona."), ("human", "Who goes there?")]
    answer = chat.invoke(messages)
    assert answer.content
    assert "".join(chunk.content for chunk in chat.stream(messages)) == answer.content


def test_disconnect_mid_stream_cancels_the_engine_request(frontend, server):
    body = {
        "model": "llm",
        "prompt": "ROMEO:",
        "max_tokens": 800,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=frontend.url, timeout=60) as http:  # noqa: SIM117
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines, strict=False) if line]
    assert len(received) >= 2
    assert wait_engine_idle(server) == (0, 0)
