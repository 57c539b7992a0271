"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API over the
chat-completions pipeline (routes/chat.py's `create` and `create_stream`, translated by
responses/translate.py), with the bounded in-memory store of responses/store.py.

A `previous_response_id` the store does not hold is a 400 with `param` previous_response_id and
`code` "previous_response_not_found", as OpenAI answers (vLLM answers 404); an unknown id on GET
or DELETE is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from openai_frontend.errors import APIError
from openai_frontend.responses import translate
from openai_frontend.responses.protocol import ResponsesRequest
from openai_frontend.responses.store import StoredResponse
from openai_frontend.routes import chat
from openai_frontend.state import State
from openai_frontend.streaming import sse_response

router = APIRouter()


class CodedError(APIError):
    """An APIError whose `code` is one of OpenAI's names rather than the HTTP status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None, code: str):
        super().__init__(status, message, type_, param)
        self.code = code

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["code"] = self.code
        return body


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, state: State):
    body.check_supported()
    store = state.responses
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise CodedError(
                400,
                f"Previous response with id '{body.previous_response_id}' not found.",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = previous.conversation()
    items = [*history, *translate.input_items(body)]
    request = translate.chat_request(body, items, body.stream)
    draft = translate.Draft(body)

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            store.put(StoredResponse(response, items))

    try:
        if body.stream:
            chunks = await chat.create_stream(request, state)
            return sse_response(translate.stream_events(draft, chunks, keep), named=True)
        completion = await chat.create(request, state)
    except APIError as exc:
        raise translate.renamed(exc) from None
    response = translate.response_from_chat(draft, completion)
    keep(response)
    return response


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State) -> dict[str, Any]:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
