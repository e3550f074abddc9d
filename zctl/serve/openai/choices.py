"""A chat or text completion's choices answered: each choice is a generation of its own,
collected whole (every choice's tokens, concurrently, then the reply) or streamed as SSE
chunks interleaved by choice until ``data: [DONE]``; a stream left early (a disconnect)
cancels the generations."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.serve.context import RunningGenerations, ServingContext, new_request_id
from zctl.serve.errors import ApiError, validate_generation
from zctl.serve.event_streams import close_all, merge_events, run_concurrently
from zctl.serve.metrics import finish_reason
from zctl.serve.openai.protocol import ChatCompletionRequest, CompletionRequest, to_generations
from zctl.serve.openai.replies import ReplyShape
from zctl.serve.sse import event_stream, sse
from zctl.service.errors import ServiceUnavailable
from zctl.service.messages import ServiceStats


async def generations_for(context: ServingContext, body: ChatCompletionRequest |
                          CompletionRequest, request: Request,
                          ) -> tuple[ServiceStats, str, list[GenerationRequest]]:
    """A completion's model served (the key and model checked), its request id, and the
    engine's request for each of its choices, each one the engine would take and all of
    them room under --max-queue."""
    info = await context.check_request(request, body.model)
    request_id = new_request_id()
    gens = [validate_generation(gen) for gen in to_generations(
        body, request_id, context.settings.speculation)]
    context.admission.check_room(len(gens))
    return info, request_id, gens


async def answer_choices(context: ServingContext, shape: ReplyShape,
                         gens: list[GenerationRequest], request: Request, start: float,
                         stream: bool, include_usage: bool) -> Response:
    """Run a generation per choice: their first answers decide between an error and a
    reply, whole or streamed."""
    running = await context.start(gens, request, shape.model, start, shape.per_prompt)
    if stream:
        return event_stream(stream_choices(context, shape, running, include_usage))
    try:
        return JSONResponse(await collect_choices(context, shape, running, request, gens))
    finally:
        await close_all(running.events)


async def collect_choices(context: ServingContext, shape: ReplyShape,
                          running: RunningGenerations, request: Request,
                          gens: list[GenerationRequest]) -> dict[str, Any]:
    """The whole reply: every choice's tokens collected (concurrently), then its end."""
    ends = await run_concurrently([
        context.collect(f, e, c, request, g)
        for f, e, c, g in zip(running.firsts, running.events, running.clocks, gens,
                              strict=True)])
    return shape.reply([done for done, _, _ in ends], [lps for _, lps, _ in ends],
                       [prompt for _, _, prompt in ends])


async def stream_choices(context: ServingContext, shape: ReplyShape,
                         running: RunningGenerations, include_usage: bool,
                         ) -> AsyncIterator[str]:
    """SSE events until [DONE]; leaving early (a disconnect) cancels the generations."""
    events, clocks = running.events, running.clocks
    try:
        if shape.chat:
            for index in range(len(events)):
                yield sse(_with_usage(shape.chunk("", None, role=True, index=index),
                                      include_usage))
        dones: dict[int, GenerationDone] = {}
        async with contextlib.aclosing(merge_events(running.firsts, events)) as merged:
            async for index, msg in merged:
                prompt_lps = msg.prompt_logprobs if isinstance(msg, GenerationChunk) else None
                if echo := shape.echo_chunk(index, prompt_lps):
                    yield sse(_with_usage(echo, include_usage))  # before its first text
                if isinstance(msg, GenerationChunk):
                    clocks[index].tokens(len(msg.tokens), time.monotonic())
                    if (msg.text or msg.logprobs) and not shape.holds(index, msg.text):
                        yield sse(_with_usage(shape.chunk(msg.text, msg.logprobs or None,
                                                          index=index), include_usage))
                    continue
                if msg.error:
                    yield sse(context.count_failure(msg).body()) + sse("[DONE]")
                    return
                dones[index] = msg
                calls, reason = shape.ending(msg)
                if shape.holds(index):  # a call at its end (or the text it was cut to)
                    yield sse(_with_usage(shape.tool_chunk(index, calls) if calls else
                                          shape.chunk(msg.text, None, index=index),
                                          include_usage))
                clocks[index].done(msg.prompt_tokens, len(msg.tokens), finish_reason(msg),
                                   time.monotonic())  # stop / length, as whole replies
                yield sse(_with_usage(shape.chunk("", None, reason, index=index),
                                      include_usage))
        if include_usage:
            yield sse(shape.usage_chunk([dones[i] for i in sorted(dones)]))
        yield sse("[DONE]")
    except ServiceUnavailable as exc:
        yield sse(ApiError(503, str(exc), "service_unavailable").body()) + sse("[DONE]")
    finally:
        await close_all(events)


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**chunk, "usage": None} if include_usage else chunk
