"""Offline generation (`LLMEngine.generate`, as vLLM's `LLM.generate`): a list of prompts queued
all or nothing, stepped to completion, their final outputs returned in order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from backend_lib.llm.core.outputs import RequestOutput
from backend_lib.llm.core.request import EngineRequest
from backend_lib.llm.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine calls in; only its type is needed here
    from backend_lib.llm.engine.llm_engine import LLMEngine

_request_ids = itertools.count()


def generate(
    engine: LLMEngine,
    prompts: Seq[str | Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    lora_names: Seq[str | None] | None = None,
) -> list[RequestOutput]:
    """Run `prompts` (texts or token id lists) to completion; final outputs in order.
    `lora_names`: each prompt's adapter (None: the base model)."""
    request_ids = _add_all(engine, _requests(prompts, params, lora_names))
    finals: dict[str, RequestOutput] = {}
    wanted = set(request_ids)
    while len(finals) < len(request_ids):
        if not engine.needs_step():  # only held requests left: sleep until a grammar is done
            engine.grammar_wait.wait_any(timeout_s=1.0)
            continue
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                finals[out.request_id] = out
    return [finals[r] for r in request_ids]


def _requests(
    prompts: Seq[str | Seq[int]],
    params: SamplingParams | Seq[SamplingParams],
    lora_names: Seq[str | None] | None,
) -> list[EngineRequest]:
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params_list) != len(prompts):
        raise ValueError("need one SamplingParams per prompt")
    loras = [None] * len(prompts) if lora_names is None else list(lora_names)
    if len(loras) != len(prompts):
        raise ValueError("need one lora name (or None) per prompt")
    requests = []
    for prompt, sp, lora in zip(prompts, params_list, loras, strict=True):
        request_id = f"generate-{next(_request_ids)}"
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        requests.append(EngineRequest(request_id, text, sp, prompt_token_ids=ids, lora_name=lora))
    return requests


def _add_all(engine: LLMEngine, requests: list[EngineRequest]) -> list[str]:
    """Queue the requests, all or nothing (a bad prompt or a full queue adds none); their
    streamed outputs are not kept, only the final ones."""
    added: list[str] = []
    try:
        for request in requests:
            engine.add(request)
            added.append(request.request_id)
            engine.outputs.requests[request.request_id].final_only = True
    except Exception:
        for request_id in added:
            engine.abort_request(request_id)
        raise
    return added
