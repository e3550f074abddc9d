"""zctl serve's stop (zctl.cli.serve), without serving: uvicorn's server takes SIGHUP as
it takes SIGTERM (unless the command ignores hang-ups), and the requests a stop cancels
are not logged as the application's errors."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.helpers.signals import stop_signals_at_defaults  # noqa: F401 - a fixture
from zctl.cli.serve import not_a_cancelled_request, stopping_server_type

pytestmark = pytest.mark.usefixtures("stop_signals_at_defaults")


class FakeServer:
    """What StoppingServer takes from uvicorn.Server: its signal capture and handle_exit."""

    def __init__(self) -> None:
        self.handled: list[int] = []

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def handle_exit(self, signum: int, frame: object) -> None:
        self.handled.append(signum)


def test_the_server_takes_sighup_as_sigterm_while_it_serves() -> None:
    server = stopping_server_type(FakeServer)()
    with server.capture_signals():
        assert signal.getsignal(signal.SIGHUP) == server.handle_exit
        signal.raise_signal(signal.SIGHUP)
    assert server.handled == [signal.SIGHUP]
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the command's own again


def test_an_ignored_hang_up_stays_ignored() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup zctl serve
    server = stopping_server_type(FakeServer)()
    with server.capture_signals():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert server.handled == []


def _record(message: str, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, (),
                             (type(exc), exc, None) if exc is not None else None)


def test_the_requests_a_stop_cancels_are_not_logged_as_errors() -> None:
    assert not not_a_cancelled_request(_record("Cancel 1 running task(s), timeout graceful "
                                               "shutdown exceeded"))
    assert not not_a_cancelled_request(_record("Exception in ASGI application\n",
                                               asyncio.CancelledError("cancelled")))
    assert not_a_cancelled_request(_record("Exception in ASGI application\n",
                                           ValueError("a real error")))
    assert not_a_cancelled_request(_record("Application startup failed"))
