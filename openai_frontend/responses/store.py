"""The stored responses: a bounded in-memory LRU of this frontend process.

A response is stored (unless its request set `store: false`) once it finished, with the input
items it was generated from, so that `previous_response_id` can continue it and
`GET`/`DELETE /v1/responses/{id}` can find it. Nothing is persisted: each frontend process has
its own store, lost on restart, and the least recently used response is evicted once
`responses_store_size` (FrontendConfig) are held; size 0 stores nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    """The response object, as answered."""
    input_items: list[dict[str, Any]]
    """Every input item it was generated from: its previous responses' items, then its own."""

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: its input, then its output."""
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    def __init__(self, size: int = 1000):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def put(self, stored: StoredResponse) -> None:
        if not self.enabled:
            return
        key = stored.response["id"]
        self._items[key] = stored
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
