"""``POST /v1/messages`` (whole, or streamed as named SSE events) and ``POST
/v1/messages/count_tokens``: a message runs the generation its chat completion would
(zctl.serve.anthropic.protocol reads it so), answered as zctl.serve.anthropic.replies
builds it, over the shared serving context (admission, --max-queue, metrics, cancellation
when the client goes). Anthropic's clients send their key as ``x-api-key``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.serve.anthropic.protocol import CountTokensRequest, MessagesRequest
from zctl.serve.anthropic.replies import (
    MessageEvents,
    MessageTokensCount,
    error_body,
    matched_stop,
    message,
    new_message_id,
)
from zctl.serve.context import ServingContext, new_request_id
from zctl.serve.encoding import event_stream, json_reply, named_events
from zctl.serve.errors import ApiError
from zctl.serve.event_streams import Events, close_all, visible_events
from zctl.serve.metrics import RequestClock
from zctl.serve.openai.protocol import to_generation
from zctl.serve.tools import ToolOutput
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import GenerationEvent


class Messages:
    """Anthropic messages over ``context``."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        start = time.monotonic()
        context = self.context
        info = await context.check_request(request, body.model, 404, x_api_key=True)
        chat = body.chat()
        gen = to_generation(chat, new_request_id(), context.settings.speculation)
        first, events, clock = await context.start_one(gen, request, info.model, start)
        tools = ToolOutput(chat.tool_plan())
        message_id = new_message_id()
        if body.stream:
            return event_stream(self._events(message_id, info.model, tools, first, events,
                                             clock, gen))
        done, _ = await context.collect_and_close(first, events, clock, request, gen)
        stop = await self._stop_sequence(done, gen)
        return json_reply(message(message_id, info.model, done, tools.calls(done), stop))

    async def _stop_sequence(self, done: GenerationDone, gen: GenerationRequest) -> str | None:
        """Which stop sequence ended the message, if one did: the text of its tokens
        tells (a grammar or a stop token ends a message as "stop" too)."""
        if done.stop_reason != "stop" or not gen.stop:
            return None
        full = await self.context.reader_text(list(done.tokens))
        return matched_stop(done.text, full, gen.stop)

    async def _events(self, message_id: str, model: str, tools: ToolOutput,
                      first: GenerationEvent, events: Events, clock: RequestClock,
                      gen: GenerationRequest) -> AsyncIterator[str]:
        """The stream's events until the message stops; leaving early (a disconnect)
        cancels the generation."""
        stream = MessageEvents(message_id, model)
        try:
            yield named_events(stream.start())
            shown = visible_events(first, events, clock, lambda text: tools.holds(0, text),
                                   None)
            async with contextlib.aclosing(shown) as msgs:
                async for msg in msgs:
                    if not isinstance(msg, GenerationDone):
                        yield named_events(stream.text(msg.text))
                        continue
                    if msg.error:
                        yield named_events([error_body(self.context.count_failure(msg))])
                        return
                    ending = stream.end(msg, tools.calls(msg), tools.holds(0),
                                        await self._stop_sequence(msg, gen))
                    yield named_events(ending)
        except (ServiceUnavailable, ApiError) as exc:  # (the service went, mid-stream)
            error = exc if isinstance(exc, ApiError) else ApiError(503, str(exc),
                                                                    "service_unavailable")
            yield named_events([error_body(error)])
        finally:
            await close_all([events])

    async def count_tokens(self, body: CountTokensRequest, request: Request
                           ) -> MessageTokensCount:
        """The prompt's tokens, as the message would count them."""
        await self.context.check_request(request, body.model, 404, x_api_key=True)
        reply = await self.context.prompt_tokens(to_generation(body.chat(), new_request_id()))
        return MessageTokensCount(input_tokens=len(reply.tokens))
