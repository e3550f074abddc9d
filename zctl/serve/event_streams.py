"""A request's generations run together on the event loop (pure asyncio, no HTTP): awaited
concurrently with the first failure cancelling the rest, their event streams merged as
events come, and closed (which cancels the generations still running); one generation's
events as its client is shown them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from zctl.engine.requests import GenerationDone, TokenLogprob
from zctl.serve.metrics import RequestClock
from zctl.service.messages import GenerationEvent

T = TypeVar("T")
Events = AsyncIterator[GenerationEvent]  # one generation's chunks, then its end


async def run_concurrently(jobs: list[Awaitable[T]]) -> list[T]:
    """The jobs' results, run concurrently (one alone is simply awaited); the first to fail
    cancels the others, and its exception is raised."""
    if len(jobs) == 1:
        return [await jobs[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]  # type: ignore[arg-type]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def close_all(events: list[Events]) -> None:
    """Close every generation's events (cancelling the generations still running)."""
    for stream in events:
        await stream.aclose()  # type: ignore[attr-defined]


async def merge_events(firsts: list[GenerationEvent], events: list[Events],
                       ) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """(index, event) from every generation as they come, each one's first event first,
    until each has ended (a GenerationDone). Left early, it stops waiting on them."""
    if len(events) == 1:  # the common case, without a task per event
        msg = firsts[0]
        while True:
            yield 0, msg
            if isinstance(msg, GenerationDone):
                return
            msg = await anext(events[0])
    for index, msg in enumerate(firsts):
        yield index, msg
    waiting = {asyncio.ensure_future(anext(events[i])): i
               for i, msg in enumerate(firsts) if not isinstance(msg, GenerationDone)}
    try:
        while waiting:
            ready, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(ready, key=waiting.__getitem__):
                index = waiting.pop(task)
                msg = task.result()
                yield index, msg
                if not isinstance(msg, GenerationDone):
                    waiting[asyncio.ensure_future(anext(events[index]))] = index
    finally:
        for task in waiting:
            task.cancel()  # each generation's iterator ends in the cancellation
        await asyncio.gather(*waiting, return_exceptions=True)


async def visible_events(first: GenerationEvent, events: Events, clock: RequestClock,
                         holds: Callable[[str], bool], logprobs: list[TokenLogprob] | None,
                         ) -> Events:
    """One generation's events as its client sees them: the chunks whose text is shown
    (not ``holds(text)``, as a call is held to its end), then its end. The clock is fed as
    tokens come and at a successful end, and ``logprobs`` (if a list) gathers every
    token's."""
    async with contextlib.aclosing(merge_events([first], [events])) as stream:
        async for _, msg in stream:
            if isinstance(msg, GenerationDone):
                if not msg.error:
                    clock.done(msg, time.monotonic())
                yield msg
                return
            clock.tokens(len(msg.tokens), time.monotonic())
            if logprobs is not None:
                logprobs += msg.logprobs
            if (msg.text or msg.logprobs) and not holds(msg.text):
                yield msg
