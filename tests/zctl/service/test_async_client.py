"""The service's asyncio client (zctl.service.async_client), the API's backend: a service
that goes away ends its requests at once and leaves nothing behind."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from tests.helpers.services import service_that_vanishes
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
