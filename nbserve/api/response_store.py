"""Responses kept in memory for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`:
bounded in count and in bytes, the oldest dropped first. Nothing is written to disk."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..types import JSONObject


@dataclass(slots=True)
class Stored:
    response: JSONObject
    conversation: list[JSONObject]  # chat messages up to and including its output
    size: int


class ResponseStore:
    """Thread-safe; `max_count` responses and `max_bytes` of their JSON at most."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 64 << 20):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: JSONObject, conversation: list[JSONObject]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + \
            len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        with self._lock:
            key = str(response["id"])
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._items[key] = Stored(response, conversation, size)
            self._bytes += size
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            item = self._items.pop(response_id, None)
            if item is not None:
                self._bytes -= item.size
            return item is not None

    def __len__(self) -> int:
        return len(self._items)
