"""The request body of `POST /v1/responses` (pydantic), with its range checks.

`input` items, `tools`, `tool_choice` and `text.format` are kept as given here and checked by
translate.py, whose errors name the exact field (`input.2.type`, `tools.0.name`). Unknown fields
are accepted and ignored, as on the other endpoints; fields that would change the answer in a way
this server cannot honour are refused by `check_supported`, naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from openai_frontend.errors import invalid_request

SAMPLING_EXTRAS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "priority",
)
"""vLLM's sampling fields (not OpenAI's Responses API) passed to chat as they are."""


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] | None = None
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema",
    "strict", "description"} (translate.py)."""
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Refused when set (check_supported).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None

    def check_supported(self) -> None:
        if self.background:
            raise invalid_request("`background` mode is not supported by this server", "background")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise invalid_request(f"`{name}` is not supported by this server", name)
        if self.truncation not in (None, "disabled"):
            raise invalid_request('only `truncation` "disabled" is supported', "truncation")

    def sampling_extras(self) -> dict[str, Any]:
        """vLLM's extra sampling fields the client set (SAMPLING_EXTRAS)."""
        extra = self.model_extra or {}
        return {name: extra[name] for name in SAMPLING_EXTRAS if extra.get(name) is not None}
