"""Signals as a terminal's command has them, for tests that send themselves SIGTERM or
SIGHUP: at their defaults meanwhile, even where the tests run with one ignored (nohup),
which zctl's commands would leave ignored (zctl.launcher.lifetime.StopSignals)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@pytest.fixture
def stop_signals_at_defaults() -> Iterator[None]:
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)
