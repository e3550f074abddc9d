"""A stage worker's cancels: the CANCEL frames it applies in order with the steps and
passes on, and the steps it skips because a cancel waiting behind them in its pipe covers
them (dataplane.wire.cancels for the frame and the marks).

Before it computes a step, the worker takes the frames waiting on its pipe into a backlog
(``_drain``, at most BACKLOG_MAX), so a cancel sent right after the steps it cancels is
seen before they are computed; the backlog is then handled in order, as if never taken.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from dataplane.runtime.base import StageRuntime
from dataplane.wire.cancels import CancelMarks, is_cancel, read_cancel
from dataplane.wire.frames import FrameError, HiddenStateFrame, decode_frame
from dataplane.wire.transport import recv_parts
from dataplane.worker.state import _StreamState
from zctl.engine.drafting import accept_prefix

BACKLOG_MAX = 64  # frames a worker takes off its pipe ahead of their turn (to see cancels)


class WorkerCancels:
    """StageWorker's handling of CANCEL frames and early skips (a mixin)."""

    runner: StageRuntime
    stage: int
    last: bool
    _pull: Any
    _backlog: deque[tuple[list[Any], int]]
    _cancels: CancelMarks

    def _count(self, name: str, n: int = 1) -> None: ...
    def _problem(self, key: str, message: str) -> None: ...
    def _send(self, header: HiddenStateFrame, body: np.ndarray | None) -> None: ...
    def _admitted(self, header: HiddenStateFrame) -> tuple[_StreamState | None, str] | None: ...

    def _on_cancel(self, header: HiddenStateFrame, payload: np.ndarray | None) -> None:
        """Cancel the stream's steps first..last (those not computed here yet are skipped
        when their turn comes, or were already: see _drain) and rewind it to the tokens the
        cancel keeps; passed on in order, so the next stage does the same."""
        sid = header.stream_id
        admitted = self._admitted(header)
        if admitted is None:
            return
        state, verdict = admitted
        try:
            rng = read_cancel(payload)
        except ValueError as exc:
            self._count("malformed")
            self._problem("cancel", f"stage {self.stage} dropped a CANCEL of stream {sid}: {exc}")
            return
        self._cancels.applied(sid, header.epoch, rng)
        if state is None or verdict == "new":  # it missed the epoch: its next step fails
            self._problem("cancel", f"stage {self.stage} got a CANCEL for epoch {header.epoch} "
                                    f"of stream {sid}, which it never saw")
        else:
            state.next_step = max(state.next_step, rng.last + 1)
            state.refuted, state.fed, state.answered = False, None, None
            state.pipelined = True
            try:
                self.runner.truncate(sid, rng.keep)
                self._count("cancels")
            except Exception as exc:  # its KV is not what the coordinator's is: refuse steps
                state.broken = f"a cancel of stream {sid} failed: {exc}"
                self._problem("cancel", f"stage {self.stage}: {state.broken}")
        if not self.last:
            header.source_stage = self.stage
            self._send(header, payload)

    def _drain(self) -> None:
        """Take the frames waiting on the pipe (up to BACKLOG_MAX) into the backlog, so a
        cancel queued behind steps it cancels is seen before they are computed."""
        while len(self._backlog) < BACKLOG_MAX:
            try:
                parts = recv_parts(self._pull, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.append((parts, time.time_ns()))
            if is_cancel(parts):
                try:
                    header, payload = decode_frame(parts)
                    self._cancels.note(header.stream_id, header.epoch, read_cancel(payload))
                except (FrameError, ValueError):
                    pass  # refused in full when its turn comes

    def _refuted(self, header: HiddenStateFrame, state: _StreamState) -> bool:
        """On the last stage, whether a guessed step is refuted by the answer this stage
        gave the stream's step before it (that step's drafts, then the guess), or follows a
        refuted one: then it is skipped (the coordinator sees the same answer and cancels
        it; that cancel ends the skipping)."""
        if not (self.last and header.guessed):
            return False
        if not state.refuted:
            fed, answered = state.fed, state.answered
            if fed is None or answered is None:
                return False  # nothing here to check it against: compute it
            drafts = fed[1:]
            state.refuted = not (answered.size > drafts.size
                                 and accept_prefix(drafts, answered) == drafts.size
                                 and int(answered[drafts.size]) == int(header.fed[0]))
            if not state.refuted:
                return False
        return self._skip(state)

    def _skip(self, state: _StreamState) -> bool:
        """Skip the step whose turn it is: its step number is used up, nothing is computed."""
        state.next_step += 1
        self._count("skipped")
        return True

    @staticmethod
    def _answered(state: _StreamState, fed: np.ndarray, logits: np.ndarray) -> None:
        """Keep what a guessed step after this one is checked against: the step's fed
        tokens and its top-1 answers (none for a step that carried no fed tokens)."""
        if fed.size:
            state.fed = fed.copy()
            state.answered = logits.reshape(-1, logits.shape[-1]).argmax(axis=-1)
        else:
            state.fed = state.answered = None

    def _skipped(self, header: HiddenStateFrame, state: _StreamState) -> bool:
        """Whether a cancel waiting behind this step covers it: then it is not computed
        (nor passed on) and its step number is used up. Only a pipelined stream's steps
        look ahead: for the others it would be ~3-5 us a step for nothing."""
        if not (state.pipelined or header.fed.size):
            return False
        state.pipelined = True
        self._drain()
        if not self._cancels.skips(header.stream_id, header.epoch, header.step):
            return False
        return self._skip(state)
