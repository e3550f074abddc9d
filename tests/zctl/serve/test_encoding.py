"""Reply models on the wire (zctl.serve.encoding): a JSON body as Starlette writes it
(UTF-8), server-sent events as compact ASCII JSON, numbers as json.dumps spells them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from pydantic import BaseModel

from zctl.serve.encoding import DONE, event_stream, json_reply, named_event, named_events, sse


class Event(BaseModel):
    type: str
    text: str
    value: float | None


async def chunks() -> AsyncIterator[str]:
    yield sse(Event(type="a", text="x", value=None))
    yield DONE


def test_an_event_is_compact_ascii_json_with_pythons_numbers() -> None:
    event = Event(type="delta", text="é😀\n", value=-1.234e-05)
    assert sse(event) == ('data: {"type":"delta","text":"\\u00e9\\ud83d\\ude00\\n",'
                          '"value":-1.234e-05}\n\n')
    assert sse(event) == f"data: {json.dumps(event.model_dump(), separators=(',', ':'))}\n\n"
    assert DONE == "data: [DONE]\n\n"


def test_named_events_carry_their_type() -> None:
    text = named_events([Event(type="a", text="", value=1.0), Event(type="b", text="y",
                                                                    value=None)])
    assert text == ('event: a\ndata: {"type":"a","text":"","value":1.0}\n\n'
                    'event: b\ndata: {"type":"b","text":"y","value":null}\n\n')
    assert named_events([]) == ""
    assert named_event("x", {"a": "é"}) == 'event: x\ndata: {"a":"\\u00e9"}\n\n'


def test_a_json_body_is_utf8() -> None:
    reply = json_reply(Event(type="t", text="é", value=1e16), 503)
    assert reply.status_code == 503 and reply.media_type == "application/json"
    assert reply.body == '{"type":"t","text":"é","value":1e+16}'.encode()


def test_a_stream_sends_its_events_as_they_come() -> None:
    reply = event_stream(chunks())
    assert reply.media_type == "text/event-stream"
    assert reply.headers["cache-control"] == "no-cache"
    assert reply.headers["x-accel-buffering"] == "no"  # a proxy passes each event on

    async def body() -> list[str]:
        return [part async for part in reply.body_iterator]

    assert asyncio.run(body()) == ['data: {"type":"a","text":"x","value":null}\n\n', DONE]
