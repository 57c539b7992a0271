"""Many concurrent streaming chat requests through the session frontend (the `openai` AsyncOpenAI
client): each equals the llm's own non-streamed greedy text for its rendered prompt, and closing
half of the streams mid-way leaves the engine with nothing running and no KV blocks held."""

from __future__ import annotations

import asyncio

import openai
import pytest

from openai_frontend.tokenization import load_tokenizer
from tests.openai.references import llm_generate, wait_engine_idle
from tooling.repository import REPO_ROOT

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_tokens": 24}
LONG = {"temperature": 0, "max_tokens": 600, "extra_body": {"ignore_eos": True}}
"""Still generating when its stream is closed (600 tokens take seconds at 32 streams)."""
SCENES = ("Verona", "Mantua", "Elsinore", "Rome")
LINES = ("Who goes there?", "What news, my lord?", "Where is the queen?", "Speak again.")
CONVERSATIONS = [
    [
        {"role": "system", "content": f"A street in {scene}."},
        {"role": "user", "content": line},
    ]
    for scene in SCENES
    for line in LINES
]


@pytest.fixture(scope="module")
def references(server) -> list[str]:
    """The llm's non-streamed greedy text for each conversation's rendered prompt."""
    tokenizer = load_tokenizer(REPO_ROOT / "models" / "shakespeare-llama")
    prompts = [tokenizer.render_chat(messages, "llm") for messages in CONVERSATIONS]
    return [llm_generate(server, prompt, GREEDY)[0][0] for prompt in prompts]


async def stream_chat(sdk: openai.AsyncOpenAI, messages, params, stop_after: int | None):
    """The joined text and last finish_reason of one streamed chat; with `stop_after`, the stream
    is closed after that many chunks with text (finish_reason then None)."""
    stream = await sdk.chat.completions.create(
        model="llm", messages=messages, stream=True, **params
    )
    text, reason, received = "", None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if stop_after is not None and received >= stop_after:
            await stream.close()
            break
    return text, reason


def run_streams(frontend, requests: list[tuple[list, dict, int | None]]) -> list[tuple[str, str]]:
    async def main():
        sdk = openai.AsyncOpenAI(
            base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=300
        )
        try:
            return await asyncio.gather(*(stream_chat(sdk, *request) for request in requests))
        finally:
            await sdk.close()

    return asyncio.run(main())


def test_32_concurrent_streams_each_equal_the_model(frontend, server, references):
    # Each conversation twice: 32 streams in flight together (the llm's max_num_seqs).
    requests = [(CONVERSATIONS[i % 16], GREEDY, None) for i in range(32)]
    results = run_streams(frontend, requests)
    for i, (text, reason) in enumerate(results):
        assert text == references[i % 16], i
        assert reason == "length"
    assert wait_engine_idle(server) == (0, 0)


def test_closing_16_of_32_streams_frees_the_engine_and_spares_the_rest(
    frontend, server, references
):
    # Even: run to the end; odd: a long generation closed after its first chunks.
    requests = [
        (CONVERSATIONS[i // 2], GREEDY, None) if i % 2 == 0 else (CONVERSATIONS[i // 2], LONG, 2)
        for i in range(32)
    ]
    results = run_streams(frontend, requests)
    for i, (text, reason) in enumerate(results):
        if i % 2 == 0:
            assert (text, reason) == (references[i // 2], "length"), i
        else:
            assert text and reason is None, i  # closed mid-stream
    assert wait_engine_idle(server) == (0, 0)
