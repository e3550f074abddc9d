"""zctl/serve/event_streams.py alone: generations awaited concurrently (the first failure
cancels the rest), their events merged as they come (each one's first first, each until
its end), and a merge left early stops waiting on them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from zctl.engine.requests import GenerationChunk, GenerationDone
from zctl.serve.event_streams import close_all, merge_events, run_concurrently


def chunk(name: str) -> GenerationChunk:
    return GenerationChunk(name, [1], name, 1)


def done(name: str) -> GenerationDone:
    return GenerationDone(name, [1], name, 1, 1.0, 1.0, {}, "eos", "")


async def events(name: str, gaps: list[float], closed: list[str]) -> AsyncIterator[object]:
    """A choice's events after its first: a chunk after each gap, then its end."""
    try:
        for gap in gaps:
            await asyncio.sleep(gap)
            yield chunk(name)
        yield done(name)
    finally:
        closed.append(name)


def test_run_concurrently_returns_in_order_and_a_failure_cancels_the_rest() -> None:
    cancelled: list[int] = []

    async def job(i: int, delay: float, fail: bool = False) -> int:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        if fail:
            raise ValueError(f"job {i} failed")
        return i

    assert asyncio.run(run_concurrently([job(0, 0.02), job(1, 0.0)])) == [0, 1]
    with pytest.raises(ValueError, match="job 1 failed"):
        asyncio.run(run_concurrently([job(0, 1.0), job(1, 0.01, fail=True)]))
    assert cancelled == [0]


def test_merge_events_yields_firsts_then_events_as_they_come() -> None:
    closed: list[str] = []

    async def run() -> list[tuple[int, str]]:
        streams = [events("a", [0.05], closed), events("b", [0.0, 0.0], closed)]
        seen = [(i, type(m).__name__[10])
                async for i, m in merge_events([chunk("a"), chunk("b")], streams)]
        await close_all(streams)
        return seen

    seen = asyncio.run(run())
    assert seen[:2] == [(0, "C"), (1, "C")]  # each choice's first event first
    assert [s for s in seen if s[0] == 1] == [(1, "C"), (1, "C"), (1, "C"), (1, "D")]
    assert seen[-1] == (0, "D")  # b's quick events came before a's slow one
    assert sorted(closed) == ["a", "b"]


def test_a_merge_left_early_stops_waiting() -> None:
    closed: list[str] = []

    async def run() -> None:
        streams = [events("a", [10.0], closed), events("b", [10.0], closed)]
        async with asyncio.timeout(2.0):  # (not the choices' 10 s)
            stream = merge_events([chunk("a"), chunk("b")], streams)
            assert [(await anext(stream))[0] for _ in range(2)] == [0, 1]
            with pytest.raises(TimeoutError):  # a client gone while both choices wait
                await asyncio.wait_for(anext(stream), 0.05)
            await close_all(streams)

    asyncio.run(run())
    assert sorted(closed) == ["a", "b"]  # each choice's generator ran to its end
