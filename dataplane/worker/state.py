"""A stage worker's bookkeeping (no sockets, no inference): its counters, what it knows of
each stream (and the last stage's check of a pipelined stream's guesses), the epoch rule
for incoming frames, and throttled logging of problems.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from zctl.engine.drafting import accept_prefix

log = logging.getLogger("zctl.dataplane.worker")


@dataclass
class WorkerStats:
    """Counters and recent compute samples of one worker (a snapshot; safe to keep)."""

    frames_in: int = 0
    steps: int = 0
    frames_out: int = 0
    malformed: int = 0  # undecodable frames
    unexpected: int = 0  # valid frames of a kind a worker does not take (REPLY)
    stale: int = 0  # frames of an epoch older than the stream's
    resets: int = 0
    implicit_resets: int = 0  # a step of a newer epoch arrived without its RESET
    closes: int = 0
    compactions: int = 0  # COMPACT frames applied
    compact_failures: int = 0  # COMPACTs this stage could not apply (logged)
    regroups: int = 0  # GROUP frames applied (streams moved into rows of a row group)
    group_failures: int = 0  # GROUP frames this stage could not apply (logged)
    prefix_saves: int = 0  # PREFIX frames applied: entries saved, loaded, dropped
    prefix_loads: int = 0
    prefix_drops: int = 0
    prefix_failures: int = 0  # SAVEs and LOADs this stage could not apply (logged)
    cancels: int = 0  # CANCEL frames applied (the stream rewound to what it keeps)
    skipped: int = 0  # steps not computed: a cancel behind them in the pipe covered them
    errors_sent: int = 0  # steps this stage refused
    errors_forwarded: int = 0  # ERROR frames from earlier stages passed on
    send_failures: int = 0  # frames dropped because the next hop did not take them
    last_problem: str = ""
    compute_ms: list[float] = field(default_factory=list)


@dataclass
class StreamState:
    """What a worker knows of a stream (or a row group) in its current epoch."""

    epoch: int
    next_step: int = 0
    closed: bool = False  # a tombstone: frames of this epoch are stale, a newer one reopens
    broken: str = ""  # a compaction or prefix load failed: the epoch's steps are refused
    # the last stage's record of the stream's last step that carried its fed tokens, and
    # its answers (top-1 per answered position): what a guessed step is checked against
    fed: np.ndarray | None = None
    answered: np.ndarray | None = None
    refuted: bool = False  # a guess was refuted: guessed steps are skipped until a cancel
    pipelined: bool = False  # the stream's steps were cancelled before, or carry fed tokens:
    # look ahead in the pipe for cancels before computing one (dataplane.worker.lookahead)

    def remember_answers(self, fed: np.ndarray, logits: np.ndarray) -> None:
        """Keep what a guessed step after this one is checked against: the step's fed
        tokens and its top-1 answers (none for a step that carried no fed tokens)."""
        if fed.size:
            self.fed = fed.copy()
            self.answered = logits.reshape(-1, logits.shape[-1]).argmax(axis=-1)
        else:
            self.fed = self.answered = None

    def refutes(self, guess: np.ndarray) -> bool:
        """Whether a guessed step (``guess``: its fed tokens) is refuted by the answer this
        stage gave the stream's step before it (that step's drafts, then the guess), or
        follows a refuted one: then it is skipped (the coordinator sees the same answer and
        cancels it; that cancel ends the refutation)."""
        if not self.refuted:
            fed, answered = self.fed, self.answered
            if fed is None or answered is None:
                return False  # nothing here to check it against: compute it
            drafts = fed[1:]
            self.refuted = not (answered.size > drafts.size
                                and accept_prefix(drafts, answered) == drafts.size
                                and int(answered[drafts.size]) == int(guess[0]))
        return self.refuted


def admit(known_epoch: int | None, epoch: int) -> str:
    """Decide a stream frame's fate from the stream's known epoch: stale, new or current."""
    if known_epoch is None or epoch > known_epoch:
        return "new"
    return "current" if epoch == known_epoch else "stale"


class ThrottledLog:
    """Log a kind of problem at most once per ``interval_s`` (a flood must not flood logs)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        extra = self._suppressed.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", message, f" (+{extra} more since last report)" if extra else "")
