"""The server's queue (``--max-queue``): the requests it holds (each generation, and each
tokenize or detokenize request while the generation service answers it), counted from the
moment they are admitted, and the 429 a request that would pass the limit gets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from zctl.serve.errors import ApiError
from zctl.serve.event_streams import Events


class Admission:
    """Requests in flight, against ``max_queue``."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.in_flight = 0

    def check_room(self, wanted: int) -> None:
        """429 unless ``wanted`` more requests fit under --max-queue."""
        if self.in_flight + wanted > self.max_queue:
            raise ApiError(429, f"the server has {self.in_flight} requests in flight (its "
                           f"limit, --max-queue, is {self.max_queue}; each of n "
                           "choices counts): retry later", "rate_limit_exceeded",
                           code="queue_full")

    def admit(self, generate: Callable[[], Events]) -> tuple[Events, Callable[[], None]]:
        """Count a generation in flight now, before anything awaits (requests arriving
        together would otherwise all pass the --max-queue check), and return its events
        (``generate()``'s, uncounted when they end or are left) and the release
        (idempotent: for a request that ends before its events are first asked for)."""
        self.in_flight += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.in_flight -= 1

        async def events() -> Events:
            inner = generate()
            try:
                async for msg in inner:
                    yield msg
            finally:
                release()
                await inner.aclose()  # type: ignore[attr-defined]

        return events(), release

    @contextmanager
    def hold(self, counted: bool = True) -> Iterator[None]:
        """``counted``: one request in flight (checked against the limit first) while the
        block runs."""
        if counted:
            self.check_room(1)
        self.in_flight += counted
        try:
            yield
        finally:
            self.in_flight -= counted
