"""A stage worker's lookahead: the frames it takes off its pipe ahead of their turn, and
the cancels among them, so that a step a cancel already covers is skipped, never computed
(dataplane.wire.cancels for the CANCEL frame).

Before it computes a pipelined stream's step, the worker takes the frames waiting on its
pipe into a backlog (at most BACKLOG_MAX), so a cancel sent right after the steps it
cancels is seen before they are computed; the backlog is then handled in order, as if
never taken.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import zmq

from dataplane.wire.cancels import CancelRange, is_cancel, read_cancel
from dataplane.wire.frames import FrameError, decode_frame
from dataplane.wire.transport import recv_parts, wait_readable

BACKLOG_MAX = 64  # frames a worker takes off its pipe ahead of their turn (to see cancels)


class CancelMarks:
    """Cancels a stage has seen ahead of their turn, by stream: a step of the marked
    epoch in a marked range is skipped when its turn comes. A mark goes when its cancel
    is applied; marks of an older epoch go when one of a newer epoch is noted."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, list[CancelRange]]] = {}

    def __len__(self) -> int:
        return sum(len(ranges) for _, ranges in self._marks.values())

    def note(self, stream_id: int, epoch: int, rng: CancelRange) -> None:
        held = self._marks.get(stream_id)
        if held is None or held[0] < epoch:
            self._marks[stream_id] = (epoch, [rng])
        elif held[0] == epoch and rng not in held[1]:
            held[1].append(rng)

    def skips(self, stream_id: int, epoch: int, step: int) -> bool:
        held = self._marks.get(stream_id)
        return held is not None and held[0] == epoch and any(r.covers(step) for r in held[1])

    def clear(self, stream_id: int, epoch: int, rng: CancelRange) -> None:
        """The cancel's turn came: its mark goes."""
        held = self._marks.get(stream_id)
        if held is None or held[0] != epoch:
            return
        if rng in held[1]:
            held[1].remove(rng)
        if not held[1]:
            del self._marks[stream_id]

    def drop_older(self, stream_id: int, epoch: int) -> None:
        """The stream is at ``epoch`` now (a RESET or CLOSE): marks of older epochs go
        (those of a cancel that was dropped as stale when its turn came, say)."""
        held = self._marks.get(stream_id)
        if held is not None and held[0] < epoch:
            del self._marks[stream_id]


class Lookahead:
    """The frames taken off the worker's inbound pipe ``pull`` ahead of their turn
    (``backlog``: each with its arrival time, handled first, in order) and the marks of the
    cancels among them (``marks``)."""

    def __init__(self, pull: zmq.Socket) -> None:
        self.pull = pull
        self.backlog: deque[tuple[list[Any], int]] = deque()
        self.marks = CancelMarks()

    def idle(self) -> bool:
        """No frame taken ahead and none waiting on the pipe."""
        return not self.backlog and not wait_readable(self.pull, 0)

    def covers(self, stream_id: int, epoch: int, step: int) -> bool:
        """Whether a cancel of the stream's epoch waiting behind step ``step`` (in the
        backlog, or on the pipe: those frames are taken first) covers it."""
        self.take_waiting()
        return self.marks.skips(stream_id, epoch, step)

    def take_waiting(self) -> None:
        """Take the frames waiting on the pipe (up to BACKLOG_MAX) into the backlog, so a
        cancel queued behind steps it cancels is seen before they are computed."""
        while len(self.backlog) < BACKLOG_MAX:
            try:
                parts = recv_parts(self.pull, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.backlog.append((parts, time.time_ns()))
            if is_cancel(parts):
                try:
                    header, payload = decode_frame(parts)
                    self.marks.note(header.stream_id, header.epoch, read_cancel(payload))
                except (FrameError, ValueError):
                    pass  # refused in full when its turn comes
