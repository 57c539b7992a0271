"""Tokenizers and chat templates of the served models, read from their checkpoint directories.

Chat templates render as transformers' `apply_chat_template` does: jinja2 in an immutable sandbox with
`trim_blocks`/`lstrip_blocks`, variables `messages`, `tools`, `add_generation_prompt`, `bos_token`,
`eos_token`, and `raise_exception`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from openai_frontend.errors import invalid_request

TEMPLATE_FILE = "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _token_text(value: Any) -> str:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


@dataclass
class ModelTokenizer:
    """A checkpoint's fast tokenizer, its special tokens and its chat template (if any)."""

    tokenizer: Tokenizer
    bos_token: str = ""
    eos_token: str = ""
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        model: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt for `messages`, ending with the assistant's generation prompt; `tools` go
        to the template as transformers passes them (templates without tool support ignore
        them)."""
        if not self.chat_template:
            raise invalid_request(
                f"model `{model}` has no chat template (its checkpoint has none and the frontend "
                "was started without --chat-template): use /v1/completions",
                "messages",
            )
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise invalid_request(
                f"the chat template refused the messages: {exc}", "messages"
            ) from None


def load_tokenizer(checkpoint: Path, chat_template_override: Path | None = None) -> ModelTokenizer:
    """The tokenizer of a checkpoint directory; the template from `chat_template_override`, else
    `chat_template.jinja` beside the tokenizer, else tokenizer_config.json's `chat_template`."""
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (checkpoint / TEMPLATE_FILE).is_file():
        template = (checkpoint / TEMPLATE_FILE).read_text(encoding="utf-8")
    if chat_template_override is not None:
        template = Path(chat_template_override).read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    # Counts and ids of the text itself: no padding to a fixed length, no truncation.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return ModelTokenizer(
        tokenizer=tokenizer,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        chat_template=template,
    )
