"""The service's asyncio client (zctl.service.async_client), the API's backend: a service
that goes away ends its requests at once and leaves nothing behind; a generation's stream
of answers, however fast, leaves the event loop to the server's other work."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from tests.helpers.services import service_that_streams, service_that_vanishes
from zctl.engine.requests import GenerationRequest
from zctl.service.async_client import AsyncServiceClient
from zctl.service.errors import ServiceUnavailable


def test_the_api_backend_ends_its_requests_when_the_service_goes_away() -> None:
    ctx = zmq.Context()
    endpoint, _ = service_that_vanishes(ctx)

    async def run() -> None:
        backend = AsyncServiceClient(endpoint, first_timeout_s=30)
        try:
            with pytest.raises(ServiceUnavailable, match="went away"):
                async for _ in backend.generate(GenerationRequest("r1", "hi", 4)):
                    pass
            assert backend._queues == {}  # nothing left behind
        finally:
            await backend.close()

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 10
    ctx.term()


def test_a_request_left_as_the_client_closes_reports_no_error_no_one_awaits() -> None:
    """The server stopping: the client's socket is closed while a request is still open, and
    the request's cancel cannot be sent. Nothing prints 'Future exception was never
    retrieved' (zctl serve's log, on SIGTERM or SIGHUP, stays clean)."""
    import gc

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    unretrieved: list[str] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unretrieved.append(context["message"]))
        backend = AsyncServiceClient(f"tcp://127.0.0.1:{port}", first_timeout_s=30)
        events = backend.generate(GenerationRequest("r1", "hi", 4))
        waiting = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.2)  # the request went out; no answer comes
        await backend.close()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await events.aclose()
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0.1)

    asyncio.run(run())
    router.close(0)
    ctx.term()
    assert unretrieved == []


def test_a_fast_stream_of_answers_leaves_the_event_loop_to_other_requests() -> None:
    """Chunks arrive faster than they are read: another task (here a stats request, as
    /metrics sends; as well a new request) still gets its turn while they stream."""
    ctx = zmq.Context()
    endpoint, thread, result = service_that_streams(ctx)

    async def run() -> None:
        backend = AsyncServiceClient(endpoint)
        chunks = 0

        async def consume() -> None:
            nonlocal chunks
            async for _ in backend.generate(GenerationRequest("r1", "hi", 4)):
                chunks += 1

        generation = asyncio.create_task(consume())
        try:
            while not chunks:
                await asyncio.sleep(0.01)
            await backend.stats(timeout_s=30)
            await generation
        finally:
            await backend.close()

    asyncio.run(run())
    thread.join(10)
    assert result == {"asked_while_streaming": True}
    ctx.term()
