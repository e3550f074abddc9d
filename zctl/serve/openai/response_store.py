"""The Responses API's store: the responses kept (``store``, the default) for
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``, each with the
conversation it ended, within a budget of bytes."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from zctl.serve.errors import ApiError
from zctl.serve.openai.responses_protocol import FunctionCallItem, MessageItem, OutputItem

STORE_BYTES = 64 << 20  # responses kept for previous_response_id and GET, by their JSON size


class ResponseStore:
    """Stored responses (``store``, the default), for ``previous_response_id`` and
    ``GET /v1/responses/{id}``: each one's object and its conversation (the input turns
    before it and its output, instructions left out as OpenAI leaves them), bounded by
    ``budget`` bytes of JSON, least recently used first out."""

    def __init__(self, budget: int = STORE_BYTES) -> None:
        self.budget = budget
        self.used = 0
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = \
            OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, body: dict[str, Any], turns: list[dict[str, Any]]) -> None:
        size = len(json.dumps(body)) + len(json.dumps(turns))
        if size > self.budget:
            return  # would evict everything and still not fit
        self.delete(body["id"])
        self._entries[body["id"]] = (body, turns, size)
        self.used += size
        while self.used > self.budget:
            _, (_, _, old) = self._entries.popitem(last=False)
            self.used -= old

    def body(self, response_id: str) -> dict[str, Any]:
        return self._get(response_id, None)[0]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation a response ended, for the one that continues it."""
        return self._get(response_id, "previous_response_id")[1]

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.used -= entry[2]
        return entry is not None

    def _get(self, response_id: str, param: str | None
             ) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(404, f"no stored response has the id {response_id!r} (responses "
                           "made with store: false are not kept, and the oldest are dropped "
                           "when the store is full)", param=param,
                           code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry


def output_turns(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as chat turns, for the conversation a later one continues."""
    calls = [{"id": i.call_id, "type": "function",
              "function": {"name": i.name, "arguments": i.arguments}}
             for i in output if isinstance(i, FunctionCallItem)]
    if calls:
        return [{"role": "assistant", "content": None, "tool_calls": calls}]
    text = "".join(p.text for i in output if isinstance(i, MessageItem) for p in i.content)
    return [{"role": "assistant", "content": text}]
