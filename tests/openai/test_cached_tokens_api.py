"""Cached-token accounting through the frontend, with the official `openai` and `anthropic`
SDKs: each API reports the prompt tokens the engine read from its prefix cache (chat and
completions: usage.prompt_tokens_details.cached_tokens, streamed or not; Responses:
usage.input_tokens_details.cached_tokens; Messages: usage.cache_read_input_tokens, with
input_tokens the rest of the prompt), and what it reports is what the engine counted as prefix
cache hits (`vllm:prefix_cache_hits_total`) for that request, and a repeated prompt reads the blocks
of its first run."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.e2e.llm_helpers import metric

pytestmark = pytest.mark.e2e
SYSTEM = "You are the chorus. " + " ".join(
    f"In act {i} the scene is Verona, and the stage is set for a quarrel." for i in range(10)
)
QUESTION = [{"role": "user", "content": "Who comes there?"}]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def sdk(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(frontend) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=frontend.url, api_key="unused", max_retries=0)


def twice(server, call) -> list[tuple[int, int]]:
    """`call()` -> (cached tokens reported, prompt tokens) twice in a row; each with the prefix
    cache hits the engine counted meanwhile."""
    runs = []
    for _ in range(2):
        before = metric(server, "vllm:prefix_cache_hits_total")
        cached, prompt = call()
        runs.append((cached, prompt, int(metric(server, "vllm:prefix_cache_hits_total") - before)))
    (first, prompt, first_hits), (again, prompt_again, hits) = runs
    assert prompt == prompt_again > 64
    assert (first, again) == (first_hits, hits)
    # The second reads the first's blocks (the first may read a chat template's header blocks).
    assert first < again < prompt
    return runs


def test_chat_reports_cached_tokens(sdk, server):
    messages = [{"role": "system", "content": f"(chat) {SYSTEM}"}, *QUESTION]

    def call():
        reply = sdk.chat.completions.create(
            model="llm", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    twice(server, call)


def test_streamed_chat_reports_cached_tokens_in_its_usage_chunk(sdk, server):
    messages = [{"role": "system", "content": f"(stream) {SYSTEM}"}, *QUESTION]

    def call():
        stream = sdk.chat.completions.create(
            model="llm",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    twice(server, call)


def test_completions_report_cached_tokens(sdk, server):
    def call():
        reply = sdk.completions.create(
            model="llm", prompt=f"(completions) {SYSTEM}", max_tokens=MAX_TOKENS, temperature=0
        )
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    twice(server, call)


def test_responses_report_cached_tokens(sdk, server):
    def call():
        reply = sdk.responses.create(
            model="llm",
            instructions=f"(responses) {SYSTEM}",
            input="Who comes there?",
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.usage.input_tokens_details.cached_tokens, reply.usage.input_tokens

    twice(server, call)


def test_messages_report_cache_read_input_tokens(claude, server):
    def call():
        message = claude.messages.create(
            model="llm",
            system=f"(messages) {SYSTEM}",
            messages=QUESTION,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},  # this SDK has no sampling arguments
        )
        usage = message.usage
        assert usage.cache_creation_input_tokens == 0
        return usage.cache_read_input_tokens, usage.input_tokens + usage.cache_read_input_tokens

    twice(server, call)
