"""This machine's turn to profile: the zctl processes of one PC (the coordinator and nodes
of a local cluster, nodes of other clusters, ``zctl node profile``) measure their profiles
one at a time, so that none times its stages while another loads the same cores.

The turn is an exclusive ``flock`` on ``profile.lock`` in the user's runtime directory
(zctl/paths.py ``runtime_dir``), the same for every process whatever its ZCTL_HOME or state
directory. ``take`` waits for it polling, so a waiter that is told to stop gives up within
a poll; a ``HeldTurn``'s descriptor may be handed to a child process (``pass_fds``), which
then holds the turn as long as either of them keeps it open (the lock belongs to the open
file, not to a process): a node killed while its child measures does not let another
process measure beside that child.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from zctl.paths import private_dir, runtime_dir

LOCK = "profile.lock"
POLL_S = 0.1  # how often a waiter tries the lock again (and looks whether to stop)


class HeldTurn:
    """The turn, held until ``release`` (or the end of a ``with`` block)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the last descriptor of the open file closed: the lock goes
            self.fd = -1

    def __enter__(self) -> HeldTurn:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


class ProfilingTurn:
    """This machine's profiling lock (``path``: default, the user's runtime directory's)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or runtime_dir() / LOCK

    def take(self, stop: threading.Event | None = None,
             on_wait: Callable[[], None] | None = None, poll_s: float = POLL_S
             ) -> HeldTurn | None:
        """Wait for the turn: the turn held, or None once ``stop`` is set (while waiting,
        within ``poll_s``). ``on_wait`` is called once when another process holds it.
        OSError when the lock file cannot be opened."""
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        told = False
        try:
            while stop is None or not stop.is_set():
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return HeldTurn(fd)
                except BlockingIOError:
                    pass
                if not told and on_wait is not None:
                    on_wait()
                told = True
                if stop is None:
                    time.sleep(poll_s)
                else:
                    stop.wait(poll_s)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def try_take(self) -> HeldTurn | None:
        """The turn if no process holds it now, else None at once (OSError when the lock
        file cannot be opened)."""
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return HeldTurn(fd)

    def wait(self, on_wait: Callable[[], None] | None = None) -> HeldTurn:
        """``take`` with nothing to stop it but an exception (KeyboardInterrupt)."""
        turn = self.take(None, on_wait)
        assert turn is not None  # only a stop gives up
        return turn
