"""Server-sent events: one event's text (or events named by their type, as the Responses
and Anthropic APIs send them), and a reply that streams them as they come."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """A reply of server-sent events, sent as they come."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def sse(data: Any) -> str:
    """One server-sent event (nothing for None)."""
    if data is None:
        return ""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


def named_events(events: list[dict[str, Any]]) -> str:
    """Events each named by its ``type`` (``event: TYPE``, then its data)."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n"
                   for e in events)
