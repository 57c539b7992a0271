"""Bad requests get OpenAI's error shape and the right status; the frontend keeps serving."""

from __future__ import annotations

import pytest

from tests.openai.references import API_KEY

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


def _chat(**fields) -> dict:
    return {"model": "llm", "messages": MSG, **fields}


def _completion(**fields) -> dict:
    return {"model": "llm", "prompt": "hi", "max_tokens": 5, **fields}


# Output constraints and tool calls (openai_frontend/structured.py, tools.py).
STRUCTURED_BAD_REQUESTS = [
    (CHAT, _chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    (CHAT, _chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        400,
        "response_format",
    ),
    (CHAT, _chat(response_format=SCHEMA, guided_json={"type": "object"}), 400, "guided_json"),
    (CHAT, _chat(tools=[WEATHER]), 400, "tool_choice"),  # "auto", the default with tools
    (CHAT, _chat(tools=[WEATHER], tool_choice="auto"), 400, "tool_choice"),
    (
        CHAT,
        _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "ghost"}}),
        400,
        "tool_choice",
    ),
    (CHAT, _chat(tools=[WEATHER], tool_choice="sometimes"), 400, "tool_choice"),
    (CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    (
        CHAT,
        _chat(tools=[WEATHER], tool_choice="required", response_format=SCHEMA),
        400,
        "tool_choice",
    ),
    (
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        400,
        "tools.0.function.name",
    ),
    (CHAT, _chat(tools=[WEATHER, WEATHER], tool_choice="required"), 400, "tools"),
    (CHAT, _chat(functions=[WEATHER["function"]]), 400, "functions"),
    (COMPLETIONS, _completion(guided_choice="Romeo"), 400, "guided_choice"),
    (COMPLETIONS, _completion(guided_regex="a(b"), 400, "guided_regex"),
    (COMPLETIONS, _completion(guided_regex="a", guided_choice=["a"]), 400, "guided_choice"),
    (
        COMPLETIONS,
        _completion(structured_outputs={"regex": "a", "grammar": 'root ::= "a"'}),
        400,
        "structured_outputs",
    ),
    (
        COMPLETIONS,
        _completion(structured_outputs={"disable_any_whitespace": True}),
        400,
        "structured_outputs",
    ),
    (
        COMPLETIONS,
        _completion(guided_regex="a", guided_whitespace_pattern=" "),
        400,
        "guided_whitespace_pattern",
    ),
    (
        COMPLETIONS,
        _completion(stream=True, structured_outputs={"choice": []}),
        400,
        "structured_outputs",
    ),
]

BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, param)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {"model": "llm"}, 400, "messages"),
    (CHAT, {"model": "llm", "messages": []}, 400, "messages"),
    (CHAT, {"model": "llm", "messages": "hi"}, 400, "messages"),
    (
        CHAT,
        {"model": "llm", "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (CHAT, {"model": "llm", "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"model": "llm", "messages": MSG, "temperature": 3}, 400, "temperature"),
    (CHAT, {"model": "llm", "messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": "llm", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"model": "llm", "messages": MSG, "max_tokens": 5000}, 400, None),
    (CHAT, {"model": "llm", "messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"model": "llm", "messages": MSG, "presence_penalty": 9}, 400, "presence_penalty"),
    (
        CHAT,
        {"model": "llm", "messages": MSG, "top_logprobs": 50, "logprobs": True},
        400,
        "top_logprobs",
    ),
    (CHAT, {"model": "llm", "messages": MSG, "stop": 5}, 400, "stop.str"),
    (
        CHAT,
        {"model": "llm", "messages": MSG, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
    ),
    (CHAT, {"model": "llm", "messages": MSG, "logit_bias": {"5": 1}}, 400, "logit_bias"),
    *STRUCTURED_BAD_REQUESTS,
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    (CHAT, {"model": "embedding", "messages": MSG}, 400, "model"),
    (
        CHAT,
        {"model": "llm", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        None,
    ),
    (CHAT, {"model": "llm", "messages": MSG, "temperature": 0, "n": 2}, 400, None),
    (COMPLETIONS, {"model": "llm", "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (COMPLETIONS, {"model": "llm", "prompt": "hi", "best_of": 2}, 400, "best_of"),
    (COMPLETIONS, {"model": "llm", "prompt": "word " * 3000}, 400, None),
    (COMPLETIONS, {"model": "llm", "prompt": ""}, 400, None),
    (COMPLETIONS, {"model": "llm", "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    (
        COMPLETIONS,
        {"model": "llm", "prompt": "hi", "stream": True, "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (COMPLETIONS, {"model": "llm", "prompt": "hi", "stream": True, "top_p": 2}, 400, "top_p"),
    ("/v1/embeddings", {"model": "embedding", "input": [[]]}, 400, "input"),
    ("/v1/embeddings", {"model": "embedding", "input": "x", "dimensions": 8}, 400, "dimensions"),
    (
        "/v1/embeddings",
        {"model": "embedding", "input": "x", "encoding_format": "int8"},
        400,
        "encoding_format",
    ),
    ("/v1/embeddings", {"model": "ghost", "input": "x"}, 404, "model"),
    ("/v1/rerank", {"query": "q"}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
    ("/detokenize", {"model": "llm", "tokens": [99999999]}, 400, "tokens"),
    ("/v1/nowhere", {}, 404, None),
    (
        CHAT,
        b'{"model": "llm", "messages": [{"role": "user", "content": "' + b"x" * 70000 + b'"}]}',
        413,
        None,
    ),
]


def _post(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request_gets_status_and_error_shape(client, path, body, status, param):
    response = _post(client, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["code"] == status
    if param is not None:
        assert error["param"] == param


def test_the_frontend_still_serves_after_bad_requests(client):
    reply = client.post(COMPLETIONS, json={"model": "llm", "prompt": "ROMEO:", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_api_key_is_required_when_set(keyed_client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = keyed_client.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert keyed_client.get("/health").status_code == 200
    ok = keyed_client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["object"] == "list"


def test_unreachable_tritonserver_is_503(unreachable_client):
    response = unreachable_client.get("/v1/models")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503
    assert unreachable_client.get("/health/ready").status_code == 503
