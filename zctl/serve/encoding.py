"""A reply model on the wire: a JSON body (``json_reply``), or server-sent events (one
model's event, or events named by their type, as the Responses and Anthropic APIs send
them) in a reply that streams them as they come.

Both are the model's JSON as ``json.dumps`` writes it (a body as Starlette's JSONResponse
writes it, UTF-8; an event's data compact ASCII, with ``\\u`` escapes): pydantic's own JSON
writer spells some numbers otherwise (``1e-05`` as ``0.00001``), and replies keep one
spelling."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"  # the end of an OpenAI stream
_JSON = json.JSONEncoder(separators=(",", ":"))  # (made once: json.dumps makes one per call)


def json_reply(reply: BaseModel, status: int = 200) -> JSONResponse:
    """A reply whose body is the model's JSON."""
    return JSONResponse(reply.model_dump(), status)


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """A reply of server-sent events, sent as they come (never cached, nor held back by a
    buffering proxy)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(event: BaseModel) -> str:
    """One server-sent event: the model as its data."""
    return f"data: {_JSON.encode(event.model_dump())}\n\n"


def named_event(name: str, data: Mapping[str, Any]) -> str:
    """One event named ``name``, ``data`` its data."""
    return f"event: {name}\ndata: {_JSON.encode(data)}\n\n"


def named_events(events: Sequence[BaseModel]) -> str:
    """Events each named by its ``type`` (``event: TYPE``, then its data)."""
    out = []
    for event in events:
        data = event.model_dump()
        out.append(named_event(data["type"], data))
    return "".join(out)
