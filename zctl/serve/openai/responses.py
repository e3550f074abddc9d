"""``POST /v1/responses`` (whole, or streamed as named SSE events), ``GET`` and ``DELETE
/v1/responses/{id}``: a response runs the generation its chat completion would
(zctl.serve.openai.responses_protocol reads it so), over the shared serving context
(admission, --max-queue, metrics, cancellation when the client goes)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from zctl.engine.requests import GenerationDone, GenerationRequest, TokenLogprob
from zctl.serve.context import ServingContext, new_request_id
from zctl.serve.encoding import event_stream, json_reply, named_events
from zctl.serve.errors import backend_down_error
from zctl.serve.event_streams import Events, close_all, visible_events
from zctl.serve.metrics import RequestClock
from zctl.serve.openai.protocol import to_generation
from zctl.serve.openai.response_store import ResponseStore, output_turns
from zctl.serve.openai.responses_protocol import (
    ResponseDeleted,
    ResponseEvent,
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    new_id,
)
from zctl.serve.tools import ToolOutput
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import GenerationEvent


class Responses:
    """Responses over ``context``; stored ones kept in ``store``."""

    def __init__(self, context: ServingContext, store: ResponseStore | None = None) -> None:
        self.context = context
        self.store = store or ResponseStore()

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        start = time.monotonic()
        context = self.context
        info = await context.check_request(request, body.model)
        history = self.store.conversation(body.previous_response_id) \
            if body.previous_response_id else []
        chat = body.chat(history)
        gen = to_generation(chat, new_request_id(), context.settings.speculation)
        first, events, clock = await context.start_one(gen, request, info.model, start)
        response = ResponseObject(body, info.model, ToolOutput(chat.tool_plan()))
        turns = [t.model_dump(exclude_none=True)  # what a later response continues
                 for t in chat.messages[1 if body.instructions else 0:]]
        if body.stream:
            return event_stream(self._events(response, first, events, clock, gen, turns))
        done, logprobs = await context.collect_and_close(first, events, clock, request, gen)
        response.finish(done, logprobs, new_id("msg"))
        self._keep(response, turns)
        return json_reply(response.body())

    def _keep(self, response: ResponseObject, turns: list[dict[str, Any]]) -> None:
        """Store a finished response (if asked to) with the conversation it ends."""
        if response.req.store:
            self.store.put(response.body().model_dump(),
                           turns + output_turns(response.output))

    async def _events(self, response: ResponseObject, first: GenerationEvent, events: Events,
                      clock: RequestClock, gen: GenerationRequest, turns: list[dict[str, Any]]
                      ) -> AsyncIterator[str]:
        """The stream's events until the response's end; leaving early (a disconnect)
        cancels the generation."""
        stream = ResponseEvents(response)
        logprobs: list[TokenLogprob] | None = [] if gen.logprobs else None
        try:
            yield named_events(stream.opening())
            shown = visible_events(first, events, clock, lambda text: response.tools.holds(
                0, text), logprobs)
            async with contextlib.aclosing(shown) as msgs:
                async for msg in msgs:
                    yield named_events(self._end(stream, msg, logprobs, turns)
                                       if isinstance(msg, GenerationDone)
                                       else stream.delta(msg.text, msg.logprobs))
        except ServiceUnavailable as exc:
            yield named_events(stream.failure(backend_down_error(exc)))
        finally:
            await close_all([events])

    def _end(self, stream: ResponseEvents, done: GenerationDone,
             logprobs: list[TokenLogprob] | None, turns: list[dict[str, Any]]
             ) -> list[ResponseEvent]:
        if done.error:
            return stream.failure(self.context.count_failure(done))
        events = stream.ending(done, logprobs, held=stream.response.tools.holds(0))
        self._keep(stream.response, turns)
        return events

    def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        self.context.check_key(request)
        return self.store.body(response_id)

    def delete(self, response_id: str, request: Request) -> ResponseDeleted:
        self.context.check_key(request)
        self.store.body(response_id)  # 404 if not stored
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)
