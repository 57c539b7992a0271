"""Query-document pairs of a causal-LM reranker (Qwen3-Reranker form), rendered with its chat
template as sentence-transformers 6.x `CrossEncoder` renders them.

A pair is the conversation [system: prompt]? [query: text] [document: text], the prompt being the
checkpoint's default prompt (config_sentence_transformers.json). The template (the tokenizer's own,
or the rerank model's `chat_template` file, as vLLM's `--chat-template` for scoring) must carry both
roles: it ends with the assistant prefill ("<think>\n\n</think>\n\n" for Qwen3) whose last token's
logits give the score. Long pairs are cut on the right at max_seq_length, then the template's tail is
written back over the last tokens, since the score is read at the final position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend_lib.config import ConfigError
from backend_lib.encoder.tokenization import TextTokenizer
from backend_lib.errors import InputError

PAIR_ROLES = ("query", "document")
"""The roles of a pair's two texts, as sentence-transformers names them."""
_STRUCTURED_MARKERS = ("content[0]", ".type", "'type'", '"type"', "item.type", "message.content[")
"""Template text showing it wants content as a list of typed parts (sentence-transformers' test)."""
_FILLERS = ("0", "1 2 3 4")
"""Two contents that tokenize differently: the longest common token tail of their renders is the
template's own tail (sentence-transformers derives it so)."""


class ChatPairTokenizer:
    """Tokenizes (query, document) pairs through a chat template; items are (ids, None)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        template: str | None,
        system_prompt: str | None,
        spec: str,
    ):
        self.text, self.system_prompt = tokenizer, system_prompt
        hf = tokenizer.tokenizer
        self.template = template if template is not None else hf.chat_template
        if not isinstance(self.template, str) or not self.template:
            raise ConfigError(
                "chat_template",
                spec,
                "a causal-LM reranker needs a chat template with 'query' and 'document' roles; "
                "the checkpoint has none",
            )
        self.structured = any(marker in self.template for marker in _STRUCTURED_MARKERS)
        self._check_roles(spec)
        self._suffix = self._template_tail()

    @property
    def max_length(self) -> int:
        return self.text.max_length

    def _content(self, text: str) -> Any:
        return [{"type": "text", "text": text}] if self.structured else text

    def conversation(self, query: str, document: str) -> list[dict[str, Any]]:
        """The messages one pair is rendered from."""
        messages = [
            {"role": role, "content": self._content(text)}
            for role, text in zip(PAIR_ROLES, (query, document), strict=True)
        ]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self._content(self.system_prompt)})
        return messages

    def _render(self, conversations: list, **kwargs: Any) -> Any:
        return self.text.tokenizer.apply_chat_template(
            conversations, chat_template=self.template, **kwargs
        )

    def _check_roles(self, spec: str) -> None:
        """Refuse a template that drops a role's content (a pair would score the template alone)."""
        probes = [("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot")]
        try:
            base, *varied = self._render(
                [self.conversation(q, d) for q, d in probes], tokenize=False
            )
        except Exception as e:  # a template error is the config's fault, said at load
            raise ConfigError("chat_template", spec, f"rendering a pair failed: {e}") from e
        dropped = [role for role, render in zip(PAIR_ROLES, varied, strict=True) if render == base]
        if dropped:
            raise ConfigError(
                "chat_template",
                spec,
                f"the template drops the {' and '.join(dropped)} content: it must render "
                "messages of roles 'query' and 'document'",
            )

    def _template_tail(self) -> list[int]:
        """Token ids the template puts after the document (its assistant prefill)."""
        first, second = (
            self._render([self.conversation(filler, filler)], tokenize=True, return_dict=True)[
                "input_ids"
            ][0]
            for filler in _FILLERS
        )
        count = 0
        for left, right in zip(reversed(first), reversed(second), strict=False):
            if left != right:
                break
            count += 1
        return first[len(first) - count :] if 0 < count < min(len(first), len(second)) else []

    def encode_pairs(
        self, queries: Sequence[str], documents: Sequence[str], truncate: bool
    ) -> list[tuple[list[int], None]]:
        """(token ids, None) per pair; `InputError` names an offending item."""
        if len(queries) != len(documents):
            raise InputError(
                f"got {len(queries)} queries but {len(documents)} documents; they must pair up"
            )
        queries = self.text.checked(queries, truncate, "query")
        documents = self.text.checked(documents, truncate, "document")
        if not queries:
            return []
        conversations = [self.conversation(q, d) for q, d in zip(queries, documents, strict=True)]
        limit = self.max_length
        ids = self._render(
            conversations,
            tokenize=True,
            return_dict=True,
            truncation=truncate,
            max_length=limit if truncate else None,
        )["input_ids"]
        if not truncate:
            self.text.check_lengths(ids, "query-document pair")
        keep = len(self._suffix)
        for row in ids:
            # Only a row cut to the limit can have lost its tail.
            if keep and len(row) >= limit:
                row[-min(keep, len(row)) :] = self._suffix[-min(keep, len(row)) :]
        return [(row, None) for row in ids]
