"""How long zctl's processes live (zctl.launcher.lifetime), without any of zctl's own
processes: a stop signal's exit code, SIGTERM and SIGHUP raised as an interruption once,
a cleanup that runs to its end, the kernel's parent-death signal and the watchdog on a
parent's pid (tried on ``sleep`` processes). (zctl's processes dying with their command:
tests/e2e/test_embedded_clusters.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from tests.helpers.signals import stop_signals_at_defaults  # noqa: F401 - a fixture
from zctl.launcher.lifetime import (
    Signalled,
    StopSignals,
    die_with_parent,
    exit_code_of,
    interrupt_once,
    signal_exit_code,
    uninterrupted,
    wait_for_exit,
    watch_parent,
)

pytestmark = pytest.mark.usefixtures("stop_signals_at_defaults")


def test_a_signal_says_itself_in_the_exit_code() -> None:
    assert signal_exit_code(signal.SIGTERM) == 143 and signal_exit_code(signal.SIGHUP) == 129
    assert exit_code_of(Signalled(signal.SIGTERM)) == 143
    assert exit_code_of(Signalled(signal.SIGHUP)) == 129
    assert exit_code_of(KeyboardInterrupt()) == 130  # Ctrl-C
    assert isinstance(Signalled(signal.SIGTERM), KeyboardInterrupt)  # cleaned up as Ctrl-C is
    assert str(Signalled(signal.SIGHUP)) == "SIGHUP"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_stop_signals_raise_once_then_the_old_handlers_are_back(signum: int) -> None:
    before = signal.getsignal(signum)
    with StopSignals() as stop:
        with pytest.raises(Signalled) as raised:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # (the handler runs at the next bytecode: never this long)
        assert raised.value.signum == signum and stop.received == signum
        os.kill(os.getpid(), signal.SIGTERM)  # a second one during cleanup: ignored
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
    assert signal.getsignal(signum) is before


def test_an_ignored_signal_stays_ignored() -> None:
    """``nohup zctl run ...``: a hang-up does not stop it."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stop.handle
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert stop.received is None and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_stop_signals_held_in_another_thread_change_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    held: list[bool] = []

    def hold() -> None:
        with StopSignals():
            held.append(signal.getsignal(signal.SIGTERM) is before)

    thread = threading.Thread(target=hold)
    thread.start()
    thread.join()
    assert held == [True]


def test_a_process_is_interrupted_by_its_first_sigterm_only() -> None:
    handle = interrupt_once()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        handle(signal.SIGTERM, None)
    handle(signal.SIGTERM, None)  # its shutdown goes on


def test_a_cleanup_runs_to_its_end_though_interrupted() -> None:
    steps: list[str] = []

    def cleanup() -> None:
        steps.append("begun")
        if steps.count("begun") < 3:
            raise Signalled(signal.SIGTERM) if len(steps) == 1 else KeyboardInterrupt()
        steps.append("done")

    with pytest.raises(Signalled):  # the first interruption, once the cleanup is done
        uninterrupted(cleanup)
    assert steps == ["begun", "begun", "begun", "done"]
    uninterrupted(lambda: steps.append("plain"))
    assert steps[-1] == "plain"


def _sleeper(**popen: object) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL, **popen)  # type: ignore[call-overload]


def test_a_tied_child_gets_sigterm_when_the_thread_that_started_it_ends() -> None:
    """PR_SET_PDEATHSIG follows the thread that started the child: here a thread that
    ends at once (for a command, its main thread: the whole process)."""
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(_sleeper(preexec_fn=die_with_parent())))
    thread.start()
    thread.join()
    try:
        assert started[0].wait(10) == -signal.SIGTERM
    finally:
        if started and started[0].poll() is None:
            started[0].kill()


def test_a_child_whose_parent_died_before_it_was_tied_exits_at_once() -> None:
    """The race the check after prctl closes: the child's parent is not the one named (as
    when the parent died before the child asked to be told), so it never runs."""
    child = _sleeper(preexec_fn=die_with_parent(parent=os.getpid() + 1_000_000))
    try:
        assert child.wait(10) == signal_exit_code(signal.SIGTERM)
    finally:
        if child.poll() is None:
            child.kill()


def test_an_untied_child_outlives_the_thread_that_started_it() -> None:
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(_sleeper()))
    thread.start()
    thread.join()
    try:
        time.sleep(0.3)
        assert started[0].poll() is None
    finally:
        started[0].kill()
        started[0].wait()


def test_the_watchdog_stops_then_forces_once_the_watched_process_ends() -> None:
    sleeper = _sleeper()
    calls: list[tuple[str, float]] = []
    forced = threading.Event()

    def force() -> None:
        calls.append(("force", time.monotonic()))
        forced.set()

    thread = watch_parent(sleeper.pid, stop=lambda: calls.append(("stop", time.monotonic())),
                          force=force, force_after_s=0.3)
    time.sleep(0.3)
    assert calls == [] and thread.daemon and thread.is_alive()  # the parent still runs
    killed = time.monotonic()
    sleeper.kill()
    sleeper.wait()
    assert forced.wait(10)
    assert [name for name, _ in calls] == ["stop", "force"]
    assert calls[0][1] >= killed and calls[1][1] - calls[0][1] >= 0.3


def test_the_watchdog_of_a_process_already_gone_stops_at_once() -> None:
    sleeper = _sleeper()
    sleeper.kill()
    sleeper.wait()
    stopped = threading.Event()
    watch_parent(sleeper.pid, stop=stopped.set, force=lambda: None, force_after_s=0)
    assert stopped.wait(10)
    wait_for_exit(sleeper.pid)  # returns: nothing to wait for
