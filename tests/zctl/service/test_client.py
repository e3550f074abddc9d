"""The service's synchronous client (zctl.service.client): a service that goes away is
noticed at once, not after the first-answer timeout."""

from __future__ import annotations

import time

import pytest
import zmq

from tests.helpers.services import service_that_vanishes
from zctl.engine.requests import GenerationRequest
from zctl.service.client import generate_many
from zctl.service.errors import ServiceUnavailable


def test_a_client_hears_at_once_that_its_service_went_away() -> None:
    ctx = zmq.Context()
    endpoint, _ = service_that_vanishes(ctx)
    start = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="went away.*1 generation"):
        list(generate_many(endpoint, [GenerationRequest("r1", "hi", 4)], first_timeout=30))
    assert time.monotonic() - start < 10  # not the 30 s first-answer timeout
    ctx.term()
