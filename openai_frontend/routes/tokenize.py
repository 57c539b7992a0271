"""`POST /tokenize`, `POST /detokenize` (vLLM's shapes), with the model's own tokenizer."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.errors import invalid_request
from openai_frontend.protocol import DetokenizeRequest, TokenizeRequest
from openai_frontend.state import State

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    info = await state.registry.get(body.model, None)
    tokenizer = state.registry.tokenizer(info)
    if body.messages is not None:
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        text = tokenizer.render_chat(messages, info.name)
    elif body.prompt is not None:
        text = body.prompt
    else:
        raise invalid_request("give `prompt` or `messages`", "prompt")
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    info = await state.registry.get(body.model, None)
    tokenizer = state.registry.tokenizer(info)
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise invalid_request(f"token ids {bad[:5]} are outside the vocabulary ({vocab})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
