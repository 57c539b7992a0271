"""The request bodies of `POST /v1/messages` and `/v1/messages/count_tokens` (pydantic), with
Anthropic's ranges.

A message's content blocks are kept as given here and read by translate.py, whose errors name the
exact block (`messages.1.content.0`). Unknown fields are accepted and ignored (`metadata`,
`service_tier`, `cache_control` on a block, ...); fields that would change the answer in a way
this server cannot honour are refused by `check_supported`, naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from openai_frontend.errors import invalid_request


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    """An assistant turn's tool call."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    """A user turn's answer to a tool call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ImageSource(_Body):
    """An image block's source: base64 data with its media type, or a URL (read under the
    frontend's fetch policy, as chat's image_url)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/png", "image/jpeg", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    def data_url(self) -> str:
        """The source as chat's image_url: a data: URL, or its URL."""
        if self.type == "url":
            if not self.url:
                raise ValueError('an image source of type "url" needs `url`')
            return self.url
        if not self.data or not self.media_type:
            raise ValueError('an image source of type "base64" needs `media_type` and `data`')
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Body):
    """A user turn's image."""

    type: Literal["image"]
    source: ImageSource


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock
BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "image": ImageBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
}
"""The content block types this server reads, by `type`."""


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]
    """A string, or content blocks (translate.py reads them with `BLOCKS`)."""


class ToolDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    """None or "custom": a client tool; Anthropic's server tools (`web_search_...`) are refused."""


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool of type "tool"."""
    disable_parallel_tool_use: bool | None = None


class OutputConfig(_Body):
    format: dict[str, Any] | None = None
    """{"type": "json_schema", "schema": {...}}: the answer's text is JSON of that schema."""
    effort: str | None = None
    """Accepted and ignored."""


class CountTokensRequest(_Body):
    """What a prompt is made of: `/v1/messages/count_tokens`'s body, and the first part of
    `/v1/messages`'."""

    model: str | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    """Refused unless {"type": "disabled"} (check_supported)."""

    def check_supported(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise invalid_request("`thinking` is not supported by this server", "thinking")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise invalid_request(
                    f"`tools.{i}.type` {tool.type!r}: server tools are not supported by this "
                    "server (only client tools: name, description, input_schema)",
                    f"tools.{i}.type",
                )

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system)
        return self.system


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    """Required, as Anthropic's API."""
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    priority: StrictInt | None = None
    """Not Anthropic's: vLLM's scheduling priority (lower first), passed to chat."""
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    """`user_id` is passed on as chat's `user` (the request's tenant unless its API key is a named
    one: tenant.py); the rest is ignored."""
