"""`num_cached_tokens` at the Triton seam (LLMService, as model.py drives it): with
`return_num_cached_tokens`, every response of a request carries the prompt tokens the engine read
from its prefix cache instead of computing them, which is exactly what the KV cache manager counted
as hits for it: 0 for a new prompt, the shared whole blocks for a repeated one, 0 for a request
asking for prompt logprobs (it reads no cached prefix)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend_lib import contract
from tests.llm.engine_helpers import engine_checkpoint
from tests.llm.service_helpers import MAX_TOKENS, service_from_context, service_parameters

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPT = " ".join(["karo mite lusa ven tor al is qu bre"] * 4)


def request(prompt: str, **params) -> dict[str, np.ndarray]:
    params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params}
    return {
        "text_input": np.array([prompt.encode()], dtype=object),
        "stream": np.array([True]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object),
        "return_num_cached_tokens": np.array([True]),
        "return_num_input_tokens": np.array([True]),
    }


def run(service, inputs) -> tuple[list[int], int, int]:
    """(num_cached_tokens of every response, the prompt's tokens, the cache hits it caused)."""
    kv = service.engine.scheduler.kv_cache_manager
    before = kv.prefix_cache_hits
    job = service.submit(inputs)
    cached, prompt = [], 0
    for result, _final in service.responses(job):
        assert not isinstance(result, Exception), result
        cached.append(int(result[contract.NUM_CACHED_TOKENS][0]))
        prompt = int(result[contract.NUM_INPUT_TOKENS][0])
    return cached, prompt, kv.prefix_cache_hits - before


def test_every_response_reports_the_prompt_tokens_read_from_the_prefix_cache():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    block_size = int(service_parameters(model_dir)["block_size"])
    try:
        first, prompt, first_hits = run(service, request(PROMPT))
        assert set(first) == {0} and first_hits == 0 and prompt > 2 * block_size
        again, _, hits = run(service, request(PROMPT))
        (cached,) = set(again)  # the same on every response
        assert cached == hits == (prompt - 1) // block_size * block_size
        # A longer prompt sharing the first one's blocks reads those.
        longer, _, hits = run(service, request(PROMPT + " tor al"))
        assert set(longer) == {hits} and hits >= cached
        # Prompt logprobs need every position computed: no cached prefix is read.
        scored, _, hits = run(service, request(PROMPT, prompt_logprobs=1))
        assert set(scored) == {0} and hits == 0
    finally:
        service.shutdown()


def test_without_the_flag_no_num_cached_tokens_output():
    model_dir, _ = engine_checkpoint("LlamaForCausalLM")
    service = service_from_context(model_dir)
    try:
        inputs = request(PROMPT)
        del inputs["return_num_cached_tokens"]
        job = service.submit(inputs)
        assert all(contract.NUM_CACHED_TOKENS not in r for r, _ in service.responses(job))
    finally:
        service.shutdown()
