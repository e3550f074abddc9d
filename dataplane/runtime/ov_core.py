"""The process's one OpenVINO Core: every stage, profile, device probe and reference
workload of a zctl process compiles and asks through it, and it lives until the process
ends.

Sharing it shares the plugins and their executors. It also keeps the process's signal
handling sound: OpenVINO's CPU plugin (2026.4.1) gives the thread that creates it an
alternate signal stack of its own, saving the one there was, and puts the saved one back
when it is destroyed. Two Cores destroyed last-made first leave the thread as it was;
destroyed in the order they were made, they leave it the first plugin's stack, unmapped
by then, and the next signal handled there on the alternate stack (Python's handlers ask
for it: SIGTERM, SIGHUP, SIGINT) kills the process with SIGSEGV instead of running its
handler. docs/measurements/robustness.md has the reproduction.
"""

from __future__ import annotations

import threading

import openvino as ov

_CORE: ov.Core | None = None
_LOCK = threading.Lock()


def shared_core() -> ov.Core:
    """The process's one OpenVINO Core (made on first use, by whichever thread asks)."""
    global _CORE
    with _LOCK:
        if _CORE is None:
            _CORE = ov.Core()
        return _CORE
