"""Anthropic's Messages API routes: ``POST /v1/messages`` (whole, or streamed as named SSE
events) and ``POST /v1/messages/count_tokens``, over the completions' machinery in
zctl.serve.app (admission, --max-queue, metrics, cancellation when the client goes) and the
shapes in zctl.serve.anthropic. Anthropic's clients send their key as ``x-api-key``."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.serve.anthropic import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    error_body,
    matched_stop,
    message,
    new_message_id,
)
from zctl.serve.choices import close_all, shown
from zctl.serve.metrics import RequestClock
from zctl.serve.protocol import ApiError, ResponseShape, to_generation
from zctl.serve.sse import event_stream, named_events
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import DetokenizeRequest

if TYPE_CHECKING:  # zctl.serve.app adds these routes
    from zctl.serve.app import ZctlApi

PATH = "/v1/messages"


class MessagesRoute:
    """Anthropic messages over ``api``."""

    def __init__(self, api: ZctlApi) -> None:
        self.api = api

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        start = time.monotonic()
        info = await self.api.served_model(request, body.model, 404, x_api_key=True)
        chat = body.chat()
        gen, first, events, clock = await self.api.start_chat(chat, request, info.model, start)
        shape = ResponseShape(True, gen.request_id, info.model, tools=chat.tool_plan())
        message_id = new_message_id()
        if body.stream:
            return event_stream(self._events(message_id, shape, first, events, clock, gen))
        done, _ = await self.api.collect_one(first, events, clock, request, gen)
        calls, _ = shape.ending(done)
        stop = await self._stop_sequence(done, gen)
        return JSONResponse(message(message_id, info.model, done, calls, stop))

    async def _stop_sequence(self, done: GenerationDone, gen: GenerationRequest) -> str | None:
        """Which stop sequence ended the message, if one did: the text of its tokens
        tells (a grammar or a stop token ends a message as "stop" too)."""
        if done.stop_reason != "stop" or not gen.stop:
            return None
        full = await self.api.tokens(DetokenizeRequest(
            uuid.uuid4().hex[:24], list(done.tokens), skip_special_tokens=True), counted=False)
        return matched_stop(done.text, full.text, gen.stop)

    async def _events(self, message_id: str, shape: ResponseShape, first: Any,
                      events: AsyncIterator[Any], clock: RequestClock, gen: GenerationRequest
                      ) -> AsyncIterator[str]:
        """The stream's events until the message stops; leaving early (a disconnect)
        cancels the generation."""
        stream = MessageEvents(message_id, shape.model)
        try:
            yield named_events(stream.start())
            holds = partial(shape.holds, 0)
            async with contextlib.aclosing(shown(first, events, clock, holds, None)) as msgs:
                async for msg in msgs:
                    if isinstance(msg, GenerationChunk):
                        yield named_events(stream.text(msg.text))
                        continue
                    if msg.error:
                        yield named_events([error_body(self.api.failure(msg))])
                        return
                    calls, _ = shape.ending(msg)
                    ending = stream.end(msg, calls, shape.holds(0),
                                        await self._stop_sequence(msg, gen))
                    yield named_events(ending)
        except (ServiceUnavailable, ApiError) as exc:  # (the service went, mid-stream)
            error = exc if isinstance(exc, ApiError) else ApiError(503, str(exc),
                                                                    "service_unavailable")
            yield named_events([error_body(error)])
        finally:
            await close_all([events])

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> dict[str, int]:
        """The prompt's tokens, as the message would count them."""
        await self.api.served_model(request, body.model, 404, x_api_key=True)
        reply = await self.api.prompt_tokens(to_generation(body.chat(), uuid.uuid4().hex[:24]))
        return {"input_tokens": len(reply.tokens)}


def add_messages_routes(app: FastAPI, api: ZctlApi) -> MessagesRoute:
    """Serve Anthropic's Messages API on ``app``."""
    route = MessagesRoute(api)

    @app.post(PATH)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await route.create(body, request)

    @app.post(f"{PATH}/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
        return JSONResponse(await route.count_tokens(body, request))

    return route
