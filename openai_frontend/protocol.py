"""Request bodies of the OpenAI-compatible endpoints (pydantic), with their range checks.

Unknown fields are accepted and ignored (as vLLM's server does); fields the frontend cannot honour
are refused by `check_supported` naming the field. What the output-constraint fields mean is
`structured.py`'s and `tools.py`'s business.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from openai_frontend.errors import invalid_request

NonNegInt = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_UNSUPPORTED_GUIDES = ("guided_whitespace_pattern",)
"""vLLM's older guided-decoding option the engine's grammar backend (xgrammar) cannot honour."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    """A data: URL (base64), a file:// URL under the frontend's allowed directory, or an http(s)
    URL where remote media are allowed (backend_lib/multimodal/image_sources.py)."""
    detail: str | None = None
    """Accepted and unused (the model's processor decides the resolution)."""


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The text parts, joined (image parts left out)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """The content as the chat template takes it: the text, or for a message with images
        transformers' parts, each image part `{"type": "image"}` where the template places the
        model's image placeholder."""
        if not self.image_urls():
            return self.text()
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
            for part in self.content
        ]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with `include_usage`, every chunk carries the usage so far (the first chunk: the
    prompt's tokens)."""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: `name`, `description` and `strict` are accepted and unused
    (the schema is always enforced)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class SamplingFields(_Body):
    """The sampling fields chat and completions share (vLLM's names and ranges)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    priority: StrictInt = 0
    """vLLM's scheduling priority, lower first; other than 0 only where the model runs
    `scheduling_policy: priority` (the engine says so otherwise)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # Output constraints (structured.py): OpenAI's, and vLLM's extras.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _refuse(self, *names: str) -> None:
        for name in names:
            if getattr(self, name, None) not in (None, [], {}):
                raise invalid_request(f"`{name}` is not supported by this server", name)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        return self.include_usage() and bool(self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    """"none", "auto", "required" or {"type": "function", "function": {"name": ...}} (tools.py)."""
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        self._refuse("logit_bias", "best_of", "functions", "function_call", *_UNSUPPORTED_GUIDES)
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("`top_logprobs` needs `logprobs` true", "top_logprobs")


TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
"""A prompt as token ids (checked against the vocabulary and max_model_len by the engine)."""


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | list[TokenIds]
    max_tokens: NonNegInt | None = None
    """0 only with `echo`: the prompt (and its logprobs) alone, as vLLM."""
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        self._refuse("logit_bias", "suffix", "best_of", *_UNSUPPORTED_GUIDES)
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request("`max_tokens` must be >= 1 unless `echo` is true", "max_tokens")
        if isinstance(self.prompt, list) and not self.prompt:
            raise invalid_request("`prompt` must not be empty", "prompt")

    @property
    def echo_only(self) -> bool:
        """Only the prompt is answered (echo with max_tokens 0)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


INPUT_TYPE_PROMPTS = {
    "query": "query",
    "search_query": "query",
    "document": "document",
    "search_document": "document",
    "passage": "document",
}
"""`input_type` of /v1/embeddings -> the prompt name it selects."""


EncoderPriority = Annotated[StrictInt, Field(ge=-(2**31), le=2**31 - 1)]
"""An encoder request's `priority`: the model's INT32 input."""


EmbeddingInput = str | Annotated[list[str], Field(min_length=1)] | list[int] | list[list[int]]
"""`/v1/embeddings` `input`: texts, or token-id items."""


class EmbeddingMessage(BaseModel):
    """A message of vLLM's multimodal `/v1/embeddings` form: a text, or text and image parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)]

    def parts(self) -> list[TextPart | ImagePart]:
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class EmbeddingRequest(_Body):
    model: str | None = None
    input: EmbeddingInput | None = None
    messages: Annotated[list[EmbeddingMessage], Field(min_length=1)] | None = None
    """vLLM's multimodal form instead of `input`: one item, a text or an image
    (`message_item`)."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    """The vector size: one of the model's Matryoshka sizes or its full size (the model checks)."""
    prompt_name: str | None = None
    """The checkpoint's prompt prepended to each text (the model checks the name)."""
    input_type: str | None = None
    """Cohere/vLLM-style alternative to `prompt_name`: see INPUT_TYPE_PROMPTS."""
    user: str | None = None
    priority: EncoderPriority = 0
    """vLLM's: the request's place in the model's micro-batch queue, lower first."""

    def resolved_prompt_name(self) -> str | None:
        """`prompt_name`, or the prompt name `input_type` stands for."""
        if self.input_type is None:
            return self.prompt_name
        if self.prompt_name is not None:
            raise invalid_request("send `prompt_name` or `input_type`, not both", "input_type")
        if self.input_type not in INPUT_TYPE_PROMPTS:
            accepted = ", ".join(f"`{t}`" for t in INPUT_TYPE_PROMPTS)
            raise invalid_request(
                f"unknown `input_type` `{self.input_type}`; accepted: {accepted}", "input_type"
            )
        return INPUT_TYPE_PROMPTS[self.input_type]

    def items(self) -> list[str] | list[list[int]]:
        """The texts, or the token-id items (checked against the vocabulary and max_seq_length
        by the model)."""
        if self.input is None:
            raise invalid_request("send `input` (texts or token ids) or `messages`", "input")
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise invalid_request("`input` must not be empty", "input")
        if isinstance(self.input[0], int):
            return [list(self.input)]
        if any(isinstance(item, list) and not item for item in self.input):
            raise invalid_request("`input` must not hold an empty list of token ids", "input")
        return list(self.input)

    def message_item(self) -> str | ImageURL | None:
        """The one item `messages` holds, as vLLM embeds a CLIP or SigLIP model's: its image,
        or its text (each message's text parts joined, the messages joined by newlines); None
        without `messages`. A 400 for `input` beside it, text and image parts together, or
        more than one image."""
        if self.messages is None:
            return None
        if self.input is not None:
            raise invalid_request("send `input` or `messages`, not both", "messages")
        parts = [part for message in self.messages for part in message.parts()]
        images = [part.image_url for part in parts if isinstance(part, ImagePart)]
        if images and len(images) < len(parts):
            raise invalid_request(
                "`messages` hold text and an image: one embedding is of a text or of an image, "
                "not both; send them in separate requests",
                "messages",
            )
        if len(images) > 1:
            raise invalid_request(f"`messages` hold {len(images)} images; send one", "messages")
        if images:
            return images[0]
        return "\n".join("".join(p.text for p in message.parts()) for message in self.messages)


class TEIEmbedSparseRequest(_Body):
    """Hugging Face TEI's `/embed_sparse` body (texts only), whose fields `/embed` shares. TEI has
    no `model` field: the frontend's only (sparse) embedding model serves it, unless the extra
    `model` names one."""

    inputs: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool | None = None
    """None: the model's own `truncate` setting (TEI's `--auto-truncate`)."""
    truncation_direction: Literal["Left", "Right", "left", "right"] = "Right"
    prompt_name: str | None = None
    model: str | None = None

    def texts(self) -> list[str]:
        if self.truncation_direction.lower() != "right":
            raise invalid_request(
                "`truncation_direction` `Left` is not supported: texts are cut on the right",
                "truncation_direction",
            )
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class TEIEmbedRequest(TEIEmbedSparseRequest):
    """Hugging Face TEI's `/embed` body: `/embed_sparse`'s fields, `normalize` and `dimensions`."""

    normalize: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Body):
    """Cohere/Jina/vLLM's rerank body, or TEI's (`texts`, `return_text`, `raw_scores`)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] | None = None
    texts: list[str] | None = None
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    return_text: bool = False
    raw_scores: bool = False
    priority: EncoderPriority = 0
    """vLLM's: the request's place in the model's micro-batch queue, lower first."""

    def is_tei(self) -> bool:
        return self.documents is None and self.texts is not None

    def document_texts(self) -> list[str]:
        if self.is_tei():
            return list(self.texts or [])
        if self.documents is None:
            raise invalid_request("`documents` is required", "documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | Annotated[list[str], Field(min_length=1)]
    text_2: str | Annotated[list[str], Field(min_length=1)]
    priority: EncoderPriority = 0
    """vLLM's: the request's place in the model's micro-batch queue, lower first."""

    def pairs(self) -> list[tuple[str, str]]:
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise invalid_request(
                f"`text_1` has {len(left)} items and `text_2` {len(right)}: give one `text_1` or "
                "as many as `text_2`",
                "text_2",
            )
        return list(zip(left, right, strict=True))


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[NonNegInt]
