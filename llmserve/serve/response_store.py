"""The Responses API's stored responses (store=true, OpenAI's default): kept in memory, the newest
--responses-store-size of them, so that GET /v1/responses/{id} reads one back and `previous_response_id` continues
its conversation (responses_routes.py). Touched on the event loop only."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from llmserve.serve.errors import ApiError

# What the stored responses may hold in all, as their JSON's length: a conversation's images (data: URLs) and long
# histories (each response keeps its whole conversation) must not grow the server without bound.
MAX_BYTES = 256 * 2**20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    messages: list[dict[str, Any]]  # the conversation to continue: earlier turns, this input, this output
    input_items: list[dict[str, Any]]  # this request's input items, each with an id
    size: int = 0  # its JSON's length, set by the store

    def measure(self) -> int:
        return sum(len(json.dumps(part, ensure_ascii=False, separators=(",", ":")))
                   for part in (self.response, self.messages, self.input_items))


class ResponseStore:
    """The newest `capacity` stored responses, by id, within `max_bytes` of JSON in all (insertion order: the oldest
    is evicted first; a response larger than the whole budget is not kept)."""

    def __init__(self, capacity: int, max_bytes: int = MAX_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> bool:
        """Keep it (and evict the oldest as needed); False where it cannot be kept (no store, or larger than the
        whole budget)."""
        if self.capacity <= 0:
            return False
        stored.size = stored.measure()
        if stored.size > self.max_bytes:
            return False
        self._items[rid] = stored
        self.num_bytes += stored.size
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._items.popitem(last=False)[1].size
        return True

    def get(self, rid: str, previous: bool = False) -> StoredResponse:
        """404 for an unknown id; as `previous_response_id`, a 400 naming that field (OpenAI's answers)."""
        stored = self._items.get(rid)
        if stored is None:
            where = "Previous response" if previous else "Response"
            raise ApiError(400 if previous else 404,
                           f"{where} with id '{rid}' not found (responses are kept in this server's memory, the "
                           f"newest {self.capacity} within {self.max_bytes // 2**20} MiB, while it runs; store=false "
                           "ones are not kept).",
                           param="previous_response_id" if previous else "response_id",
                           code="previous_response_not_found" if previous else None)
        return stored

    def delete(self, rid: str) -> None:
        self.num_bytes -= self.get(rid).size
        del self._items[rid]
