"""Anthropic's Messages API routes: ``POST /v1/messages`` (whole, or streamed as named SSE
events) and ``POST /v1/messages/count_tokens``, over the completions' machinery in
serve.app (admission, --max-queue, metrics, cancellation when the client goes) and the
shapes in serve.anthropic. Anthropic's clients send their key as ``x-api-key``."""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from controlplane.service_messages import (
    DetokenizeRequest,
    GenerateChunk,
    GenerateDone,
    ServiceStats,
    TokenizeRequest,
)
from engine.requests import GenerationRequest
from serve.anthropic import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    error_body,
    matched_stop,
    message,
    new_message_id,
)
from serve.backend import BackendUnavailable
from serve.choices import close_all, shown
from serve.errors import unknown_model
from serve.metrics import RequestClock
from serve.protocol import ApiError, ResponseShape, engine_error, finish_reason, to_generation
from serve.sse import event_stream, named_events

if TYPE_CHECKING:  # serve.app adds these routes
    from serve.app import ZctlApi

PATH = "/v1/messages"


class MessagesRoute:
    """Anthropic messages over ``api``."""

    def __init__(self, api: ZctlApi) -> None:
        self.api = api

    def check_key(self, request: Request) -> None:
        """The key as ``x-api-key`` (Anthropic's header) or as a bearer token."""
        key, given = self.api.settings.api_key, request.headers.get("x-api-key")
        if key and given is not None:
            if not hmac.compare_digest(given.encode("latin-1"), key.encode()):
                raise ApiError(401, "wrong API key (x-api-key)", "authentication_error",
                               code="invalid_api_key")
            return
        self.api.check_key(request)

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        start = time.monotonic()
        self.check_key(request)
        info = self._served(await self.api.served(), body.model)
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

    def _served(self, info: ServiceStats, model: str) -> ServiceStats:
        if model not in self.api.names(info):
            raise unknown_model(404, model, info.model)  # (a body naming it: Anthropic's 404)
        return info

    async def _stop_sequence(self, done: GenerateDone, gen: GenerationRequest) -> str | None:
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
                    if isinstance(msg, GenerateChunk):
                        yield named_events(stream.text(msg.text))
                        continue
                    if msg.error:
                        error = engine_error(msg)
                        self.api.metrics.errors.labels(str(error.status)).inc()
                        yield named_events([error_body(error)])
                        return
                    clock.done(msg.prompt_tokens, len(msg.tokens), finish_reason(msg),
                               time.monotonic())
                    calls, _ = shape.ending(msg)
                    ending = stream.end(msg, calls, shape.holds(0),
                                        await self._stop_sequence(msg, gen))
                    yield named_events(ending)
        except (BackendUnavailable, ApiError) as exc:  # (the service went, mid-stream)
            error = exc if isinstance(exc, ApiError) else ApiError(503, str(exc),
                                                                    "service_unavailable")
            yield named_events([error_body(error)])
        finally:
            await close_all([events])

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> dict[str, int]:
        """The prompt's tokens, as the message would count them."""
        self.check_key(request)
        self._served(await self.api.served(), body.model)
        gen = to_generation(body.chat(), uuid.uuid4().hex[:24])
        problem = gen.problem()
        if problem is not None:
            raise ApiError(400, problem)
        return {"input_tokens": len((await self.api.tokens(TokenizeRequest(**vars(gen)))).tokens)}


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
