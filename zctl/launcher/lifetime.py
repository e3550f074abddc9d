"""How long zctl's processes live: a command ends the same way on Ctrl-C, SIGTERM and
SIGHUP, and the processes it starts for itself (an embedded cluster) end with it.

A command (``zctl run``, ``zctl serve``) holds ``StopSignals`` while it runs: SIGTERM and
SIGHUP then raise ``Signalled``, a KeyboardInterrupt, so the command's cleanup (a cancelled
generation, a stopped embedded cluster) runs for them exactly as for Ctrl-C, and it exits
with 128 + the signal's number (``exit_code_of``). The processes it starts are tied to it
twice, as either alone can miss: the kernel sends them SIGTERM when it dies
(``die_with_parent``, PR_SET_PDEATHSIG, set in the child before exec), and each watches its
command's pid itself (``watch_parent``) and shuts down as on SIGTERM when it is gone.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from zctl.launcher.record import alive

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # end a command as Ctrl-C (SIGINT) does
PARENT_DEATH_SIGNAL = signal.SIGTERM  # what the kernel sends a tied process
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_POLL_S = 0.5  # how often a watchdog without pidfd looks for its parent
FORCE_AFTER_S = 3.0  # a process still running this long after its parent died is ended


def signal_exit_code(signum: int) -> int:
    """The exit code of a command ended by signal ``signum`` (the shells' 128 + n)."""
    return 128 + int(signum)


class Signalled(KeyboardInterrupt):
    """The command was asked to stop by ``signum`` (SIGTERM, SIGHUP): it ends as on Ctrl-C,
    with exit code 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return signal_exit_code(self.signum)


def exit_code_of(interrupt: KeyboardInterrupt) -> int:
    """The exit code of a command that ``interrupt`` ended: 128 + its signal (130 for Ctrl-C)."""
    if isinstance(interrupt, Signalled):
        return interrupt.exit_code
    return signal_exit_code(signal.SIGINT)


class StopSignals:
    """While held: the first SIGTERM or SIGHUP raises ``Signalled`` in the main thread;
    later ones are ignored, so the cleanup it starts runs to its end. The previous handlers
    are back afterwards. ``received``: the signal that came, or None. A signal this process
    ignores stays ignored (``nohup zctl run``: SIGHUP). (Held in another thread, it changes
    nothing: only the main thread may set signal handlers.)"""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        raise Signalled(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # (only it may set them)
            self._previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS
                              if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # (None: set in C)
        self._previous = {}


def interrupt_once() -> Callable[[int, FrameType | None], None]:
    """A SIGTERM handler for a long-running process: the first raises KeyboardInterrupt (its
    clean shutdown), later ones are ignored so that shutdown is not cut short."""
    came: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if not came:
            came.append(signum)
            raise KeyboardInterrupt(signal.Signals(signum).name)

    return handle


def die_with_parent(parent: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when the thread
    that starts it ends (the whole process, when that is the main thread). ``parent``
    (default: this process) is checked after the request: had it died already, before
    the request was made, the child exits at once instead of living on unseen."""
    expected = os.getpid() if parent is None else parent
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != expected:
            os._exit(signal_exit_code(PARENT_DEATH_SIGNAL))

    return tie


def force_exit() -> None:
    """End this process now (its clean shutdown took too long)."""
    os._exit(signal_exit_code(PARENT_DEATH_SIGNAL))


def stop_self() -> None:
    """Start this process's clean shutdown, as a SIGTERM from outside does."""
    os.kill(os.getpid(), signal.SIGTERM)


def watch_parent(parent: int, stop: Callable[[], None] = stop_self,
                 force: Callable[[], None] = force_exit,
                 force_after_s: float = FORCE_AFTER_S) -> threading.Thread:
    """A daemon thread that waits for process ``parent`` to end (at once if it already
    has), then calls ``stop`` (default: SIGTERM to this process, its clean shutdown) and,
    should this process still run ``force_after_s`` later, ``force`` (default: exit now)."""

    def watch() -> None:
        wait_for_exit(parent)
        stop()
        time.sleep(force_after_s)
        force()

    thread = threading.Thread(target=watch, name=f"parent-{parent}-watchdog", daemon=True)
    thread.start()
    return thread


def wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` has ended (a zombie has); at once if there is none."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (a kernel before 5.3): look every WATCH_POLL_S
        while alive(pid):
            time.sleep(WATCH_POLL_S)
        return
    try:
        select.select([fd], [], [])  # readable once the process has ended
    finally:
        os.close(fd)



def uninterrupted(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` to its end though Ctrl-C or a stop signal interrupt it (it is begun
    again, so it must be safe to repeat), then raise the first interruption again."""
    first: KeyboardInterrupt | None = None
    while True:
        try:
            cleanup()
            break
        except KeyboardInterrupt as exc:
            first = first or exc
    if first is not None:
        raise first
