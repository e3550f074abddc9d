"""Generations through a running cluster's service, on a client thread, for tests that do
something to the cluster while tokens flow."""

from __future__ import annotations

import threading

from zctl.engine.requests import GenerationChunk, GenerationRequest
from zctl.service.client import generate_many


def generating_client(serve: str, requests: list[GenerationRequest],
                      messages: list) -> threading.Thread:
    """The ``requests`` on a client thread of the service at ``serve`` (every message into
    ``messages``), returned once tokens flow."""
    generating = threading.Event()

    def run() -> None:
        for msg in generate_many(serve, requests):
            messages.append(msg)
            if isinstance(msg, GenerationChunk) and msg.tokens:
                generating.set()

    client = threading.Thread(target=run, daemon=True)
    client.start()
    assert generating.wait(60)
    return client
