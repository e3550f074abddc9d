"""This machine's turn to profile: one holder at a time, a waiter told once, a stop that
ends the wait, and a held turn that a child process keeps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from controlplane.profile_turn import LOCK, ProfilingTurn
from zctl.paths import runtime_dir


def test_the_turn_s_lock_is_in_the_user_s_runtime_dir(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert ProfilingTurn().path == runtime_dir() / LOCK == tmp_path / "zctl" / LOCK


def test_one_holder_at_a_time_and_a_waiter_is_told_once(tmp_path: Path) -> None:
    turn = ProfilingTurn(tmp_path / "run" / LOCK)
    first = turn.wait()
    told: list[float] = []
    got: list[float] = []

    def second() -> None:
        with turn.wait(lambda: told.append(time.monotonic())):
            got.append(time.monotonic())

    waiter = threading.Thread(target=second)
    waiter.start()
    time.sleep(0.5)
    assert len(told) == 1 and not got  # waiting, told once
    released = time.monotonic()
    first.release()
    waiter.join(5)
    assert not waiter.is_alive() and got and got[0] >= released
    again = turn.take(threading.Event())  # free again once the second let go
    assert again is not None
    again.release()


def test_a_stop_ends_the_wait_within_a_poll(tmp_path: Path) -> None:
    turn = ProfilingTurn(tmp_path / LOCK)
    held = turn.wait()
    stop = threading.Event()
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(turn.take(stop, poll_s=0.05)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    stop.set()
    waiter.join(1.0)
    assert not waiter.is_alive() and result == [None]
    held.release()
    assert turn.take(stop) is None  # a stop already set: no turn, even a free one


def test_a_lock_file_that_cannot_be_made_says_why(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("a file where the directory should be")
    with pytest.raises(OSError):
        ProfilingTurn(tmp_path / "run" / LOCK).wait()
