"""The Responses API's routes: ``POST /v1/responses`` (whole, or streamed as named SSE
events), ``GET`` and ``DELETE /v1/responses/{id}``, over the completions' machinery in
zctl.serve.app (admission, --max-queue, metrics, cancellation when the client goes) and the
shapes in zctl.serve.responses."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest, TokenLogprob
from zctl.serve.choices import close_all, shown
from zctl.serve.metrics import RequestClock
from zctl.serve.protocol import ApiError, ResponseShape
from zctl.serve.responses import (
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    new_id,
    output_turns,
)
from zctl.serve.sse import event_stream, named_events
from zctl.service.errors import ServiceUnavailable

if TYPE_CHECKING:  # zctl.serve.app adds these routes
    from zctl.serve.app import ZctlApi


class ResponsesRoute:
    """Responses over ``api``; stored ones kept in ``store``."""

    def __init__(self, api: ZctlApi, store: ResponseStore | None = None) -> None:
        self.api = api
        self.store = store or ResponseStore()

    async def respond(self, body: ResponsesRequest, request: Request) -> Response:
        start = time.monotonic()
        info = await self.api.served_model(request, body.model)
        history = self.store.conversation(body.previous_response_id) \
            if body.previous_response_id else []
        chat = body.chat(history)
        gen, first, events, clock = await self.api.start_chat(chat, request, info.model, start)
        shape = ResponseShape(True, gen.request_id, info.model, tools=chat.tool_plan())
        response = ResponseObject(body, info.model, shape)
        turns = [t.model_dump(exclude_none=True)  # what a later response continues
                 for t in chat.messages[1 if body.instructions else 0:]]
        if body.stream:
            return event_stream(self._events(response, first, events, clock, gen, turns))
        done, logprobs = await self.api.collect_one(first, events, clock, request, gen)
        response.finish(done, logprobs, new_id("msg"))
        self._keep(response, turns)
        return JSONResponse(response.body())

    def _keep(self, response: ResponseObject, turns: list[dict[str, Any]]) -> None:
        """Store a finished response (if asked to) with the conversation it ends."""
        if response.req.store:
            self.store.put(response.body(), turns + output_turns(response.output))

    async def _events(self, response: ResponseObject, first: Any, events: AsyncIterator[Any],
                      clock: RequestClock, gen: GenerationRequest, turns: list[dict[str, Any]]
                      ) -> AsyncIterator[str]:
        """The stream's events until the response's end; leaving early (a disconnect)
        cancels the generation."""
        stream = ResponseEvents(response)
        logprobs: list[TokenLogprob] | None = [] if gen.logprobs else None
        try:
            yield named_events(stream.opening())
            holds = partial(response.shape.holds, 0)
            async with contextlib.aclosing(shown(first, events, clock, holds, logprobs)) as msgs:
                async for msg in msgs:
                    events_now = stream.delta(msg.text, msg.logprobs) \
                        if isinstance(msg, GenerationChunk) \
                        else self._end(stream, msg, logprobs, turns)
                    yield named_events(events_now)
        except ServiceUnavailable as exc:
            error = ApiError(503, str(exc), "service_unavailable", code="backend_down")
            yield named_events(stream.failed(error))
        finally:
            await close_all([events])

    def _end(self, stream: ResponseEvents, done: GenerationDone,
             logprobs: list[TokenLogprob] | None, turns: list[dict[str, Any]]
             ) -> list[dict[str, Any]]:
        if done.error:
            return stream.failed(self.api.failure(done))
        events = stream.ending(done, logprobs, held=stream.response.shape.holds(0))
        self._keep(stream.response, turns)
        return events

    def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        self.api.check_key(request)
        return self.store.body(response_id)

    def delete(self, response_id: str, request: Request) -> dict[str, Any]:
        self.api.check_key(request)
        self.store.body(response_id)  # 404 if not stored
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def add_responses_routes(app: FastAPI, api: ZctlApi) -> ResponsesRoute:
    """Serve the Responses API on ``app``."""
    route = ResponsesRoute(api)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await route.respond(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> JSONResponse:
        return JSONResponse(route.retrieve(response_id, request))

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> JSONResponse:
        return JSONResponse(route.delete(response_id, request))

    return route
