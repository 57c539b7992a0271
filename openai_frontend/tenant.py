"""The tenant a generating request is served for, passed to the llm as `tenant` in its
sampling_parameters (fair share, per-tenant limits and metrics: backend_lib/llm/core/tenants.py):

1. the name of the API key the client authenticated with, when the frontend has named keys
   (`--api-keys-file`, a JSON object name -> key); a named key wins, so a client cannot take
   another tenant's share or escape its own limits by changing `user`;
2. else the request's `user` (OpenAI's chat, completions and Responses field; Anthropic's
   `metadata.user_id`);
3. else none: the llm counts the request under its LoRA adapter, or "default".

The middleware (app.py) puts the key's name in CURRENT for the request; `tenant`, called where
sampling parameters are built (sampling.py), reads it.
"""

from __future__ import annotations

import json
import secrets
from contextvars import ContextVar
from pathlib import Path

CURRENT: ContextVar[str | None] = ContextVar("api_key_name", default=None)
"""The name of the API key this request authenticated with (None: none, or an unnamed key)."""


def tenant(user: str | None) -> str | None:
    """The current request's tenant: its key's name, else `user`, else None."""
    return CURRENT.get() or user or None


class NamedKeyError(ValueError):
    """The API keys file is unreadable or malformed."""


def read_named_keys(path: Path) -> dict[str, str]:
    """The API keys file: a JSON object of key name -> key, both non-empty strings, no key
    twice."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NamedKeyError(f"cannot read it as JSON: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise NamedKeyError("expected a non-empty JSON object of key name -> key")
    for name, key in raw.items():
        if not name or not isinstance(key, str) or not key.strip():
            raise NamedKeyError(f"key {name!r}: expected a non-empty string")
    if len(set(raw.values())) != len(raw):
        raise NamedKeyError("two names share one key")
    return dict(raw)


def key_name(given: str, keys: dict[str, str]) -> str | None:
    """The name of `given` among `keys` (None: no match), comparing every key in constant
    time."""
    found = None
    for name, key in keys.items():
        if secrets.compare_digest(given.encode(), key.encode()):
            found = name
    return found
