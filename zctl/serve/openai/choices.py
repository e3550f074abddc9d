"""A chat or text completion's choices answered: each choice is a generation of its own,
collected whole (every choice's tokens, concurrently, then the reply) or streamed as SSE
chunks interleaved by choice until ``data: [DONE]``, each API's replies built by its own
``ChoiceReplies``; a stream left early (a disconnect) cancels the generations."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from zctl.engine.requests import GenerationChunk, GenerationDone, GenerationRequest
from zctl.serve.context import RunningGenerations, ServingContext, new_request_id
from zctl.serve.encoding import DONE, event_stream, json_reply, sse
from zctl.serve.errors import ApiError, validate_generation
from zctl.serve.event_streams import close_all, merge_events, run_concurrently
from zctl.serve.openai.protocol import ChatCompletionRequest, CompletionRequest, to_generations
from zctl.serve.openai.replies import ChoiceReplies
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


async def answer_choices(context: ServingContext, replies: ChoiceReplies,
                         gens: list[GenerationRequest], request: Request, start: float,
                         stream: bool) -> Response:
    """Run a generation per choice: their first answers decide between an error and a
    reply, whole or streamed."""
    running = await context.start(gens, request, replies.model, start, replies.per_prompt)
    if stream:
        return event_stream(stream_choices(context, replies, running))
    try:
        return json_reply(await collect_choices(context, replies, running, request, gens))
    finally:
        await close_all(running.events)


async def collect_choices(context: ServingContext, replies: ChoiceReplies,
                          running: RunningGenerations, request: Request,
                          gens: list[GenerationRequest]) -> BaseModel:
    """The whole reply: every choice's tokens collected (concurrently), then its end."""
    ends = await run_concurrently([
        context.collect(f, e, c, request, g)
        for f, e, c, g in zip(running.firsts, running.events, running.clocks, gens,
                              strict=True)])
    return replies.reply([done for done, _, _ in ends], [lps for _, lps, _ in ends],
                         [prompt for _, _, prompt in ends])


async def stream_choices(context: ServingContext, replies: ChoiceReplies,
                         running: RunningGenerations) -> AsyncIterator[str]:
    """SSE events until [DONE]; leaving early (a disconnect) cancels the generations."""
    events, clocks = running.events, running.clocks
    try:
        for chunk in replies.opening(len(events)):
            yield sse(chunk)
        dones: dict[int, GenerationDone] = {}
        async with contextlib.aclosing(merge_events(running.firsts, events)) as merged:
            async for index, msg in merged:
                if isinstance(msg, GenerationChunk):
                    shown = replies.text_chunks(index, msg)
                    clocks[index].tokens(len(msg.tokens), time.monotonic())
                    for chunk in shown:
                        yield sse(chunk)
                    continue
                if msg.error:
                    yield sse(context.count_failure(msg).body()) + DONE
                    return
                dones[index] = msg
                held, finish = replies.ending(index, msg)
                for chunk in held:  # a call at its end (or the text it was cut to), an echo
                    yield sse(chunk)
                clocks[index].done(msg, time.monotonic())  # stop / length, as whole replies
                yield sse(finish)
        for chunk in replies.closing([dones[i] for i in sorted(dones)]):
            yield sse(chunk)
        yield DONE
    except ServiceUnavailable as exc:
        yield sse(ApiError(503, str(exc), "service_unavailable").body()) + DONE
    finally:
        await close_all(events)
