"""The cluster head's answers: the last stage's replies collected from the reply pipe,
steps that outlive the pipeline's timeout expired, and the answers of steps the head ran
to the last stage itself (a ``StageChain`` of every stage).

A mixin of ``dataplane.head.cluster_head.ClusterHead``, which owns the state it reads: the steps in
flight (``_pending``), the answers not yet taken (``_done``) and the reply pipe.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import zmq

from dataplane.head.figures import StepFigures
from dataplane.head.types import (
    ClusterReply,
    ClusterStats,
    DataPlaneError,
    StageFailed,
    StageTimeout,
    reply_from_frame,
)
from dataplane.wire.frames import FrameError, HiddenStateFrame, Kind, ReplyMode, decode_frame
from dataplane.wire.reply_records import reply_payload
from dataplane.wire.timing import TimingStamps, TimingWindow, compute_ms
from dataplane.wire.transport import deadline_after, recv_parts, remaining, wait_readable

log = logging.getLogger("zctl.dataplane.cluster")
IO_SLICE_S = 0.05  # the longest one wait on the reply pipe holds it (callers loop)


class HeadReplies:
    """ClusterHead's part of the Executor that takes answers (a mixin)."""

    stage0: Any
    num_stages: int
    next_addr: str
    reply_endpoint: str
    timeout_s: float
    figures: StepFigures
    stats: ClusterStats
    timings: TimingWindow
    _pull: Any
    _pending: dict[int, Any]
    _done: dict[int, ClusterReply | DataPlaneError]
    _waiting_since: int
    _io: Any  # a lock: the pipes' use, against ``close`` from another thread

    def _check_open(self) -> None: ...

    def _mark_broken(self, stream_id: int, epoch: int, why: str) -> None: ...

    @property
    def in_flight(self) -> list[int]:
        """Request ids submitted and not yet answered, oldest first."""
        return list(self._pending)

    def collect(self, request_id: int, timeout_s: float | None = None) -> ClusterReply:
        """Wait for one request's answer (others arriving meanwhile are kept for later)."""
        if request_id not in self._done and request_id not in self._pending:
            raise DataPlaneError(f"request {request_id} is unknown, already collected, or was "
                                 "abandoned by a reset")
        deadline = deadline_after(timeout_s)
        while request_id not in self._done:
            pending = self._pending.get(request_id)
            if pending is None:
                raise DataPlaneError(f"request {request_id} was abandoned by a reset")
            if not self._pump(_wait_s(pending.deadline, deadline)):
                if time.monotonic() >= pending.deadline:
                    self._expire(request_id)
                elif deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"request {request_id} not answered within {timeout_s} s")
        return self._take(request_id)

    def collect_any(self, timeout_s: float | None = None) -> ClusterReply | None:
        """The next answered request, in arrival order; None if none within ``timeout_s``.

        Raises the request's DataPlaneError (with its request_id) when it failed or
        outlived the pipeline's ``timeout_s``.
        """
        deadline = deadline_after(timeout_s)
        while not self._done:
            if not self._pending:
                return None
            oldest = next(iter(self._pending))
            if time.monotonic() >= self._pending[oldest].deadline:
                self._expire(oldest)
                break
            if (not self._pump(_wait_s(self._pending[oldest].deadline, deadline))
                    and deadline is not None and time.monotonic() >= deadline):
                return None
        return self._take(next(iter(self._done)))

    def _take(self, request_id: int) -> ClusterReply:
        result = self._done.pop(request_id)
        if isinstance(result, DataPlaneError):
            raise result
        return result

    def _expire(self, request_id: int) -> None:
        pending = self._pending.pop(request_id)
        self.stats.timeouts += 1
        stages = tuple(range(1, self.num_stages))
        who = (f"stage 1 ({self.next_addr})" if len(stages) == 1 else
               f"one of stages 1-{stages[-1]} (first hop {self.next_addr})")
        message = (f"no answer for stream {pending.stream_id} step {pending.step} (request "
                   f"{request_id}) within {self.timeout_s:.1f} s: {who} did not answer; check "
                   f"that the workers run and the last stage sends to {self.reply_endpoint}")
        self._mark_broken(pending.stream_id, pending.epoch, message)
        self._done[request_id] = StageTimeout(message, pending.stream_id, request_id, stages)

    def _answer_here(self, header: HiddenStateFrame, logits: np.ndarray, top_k: int,
                     vocab: int, compute_ms: float) -> int:
        """File the answer of a step whose last stage ran here (see ``answers_here``): the
        payload a last stage would send (``reply_payload``), read as its reply would be."""
        payload = reply_payload(logits, header.reply, top_k)
        if header.reply == ReplyMode.LOGITS:
            payload = payload.copy()  # a view of the output tensor the next step overwrites
        reply = reply_from_frame(header, payload, top_k, vocab)
        rid = header.request_id
        reply.stage_ms = [compute_ms]
        self.figures.add_stage_ms(reply.stage_ms)
        self.stats.submitted += 1
        self.stats.replies += 1
        self._done[rid] = reply
        return rid

    # -- receiving -------------------------------------------------------------------
    def _prefetch_in_flight(self) -> None:
        """While waiting for replies, bind stage 0's likely next inputs of every stream
        with a step in flight (StageRunner.prefetch): off the critical path."""
        for pending in list(self._pending.values()):
            try:
                self.stage0.prefetch(pending.stream_id)
            except Exception as exc:  # a guess must never break a stream
                log.debug("stage 0 could not prefetch stream %s: %s", pending.stream_id, exc)

    def _pump(self, timeout_s: float | None) -> bool:
        """Wait up to timeout_s for one message from the last stage and file it.

        Back-to-back empty polls count as one wait: the reply's hop is ready since the
        first (else a slow hop's time would show as queueing behind the poll interval).
        """
        with self._io:  # (in slices: a ``close`` from another thread waits one at most)
            self._check_open()
            if timeout_s != 0 and self._pending and not wait_readable(self._pull, 0):
                self._prefetch_in_flight()
                self.figures.drain_when_idle()
            ready_ns = self._waiting_since or time.time_ns()
            wait_s = IO_SLICE_S if timeout_s is None else min(timeout_s, IO_SLICE_S)
            if not wait_readable(self._pull, wait_s):
                self._waiting_since = ready_ns
                return False
            try:
                parts = recv_parts(self._pull, zmq.NOBLOCK)
            except zmq.Again:
                return False
        recv_ns = time.time_ns()
        self._waiting_since = 0
        self.figures.received_bytes += sum(map(len, parts))
        t0 = time.perf_counter_ns()
        try:
            header, payload = decode_frame(parts)
        except FrameError as exc:
            self.stats.malformed += 1
            log.warning("dropped a malformed reply: %s", exc)
            return True
        decode_ns = time.perf_counter_ns() - t0
        pending = self._pending.get(header.request_id)
        if (pending is None or pending.epoch != header.epoch
                or pending.stream_id != header.stream_id):
            self.stats.stale_replies += 1
            return True
        if header.kind == Kind.ERROR:
            del self._pending[header.request_id]
            self.stats.errors += 1
            message = (f"stream {header.stream_id} step {header.step} failed at "
                       f"{header.error or f'stage {header.source_stage}'}")
            self._mark_broken(header.stream_id, header.epoch, message)
            self._done[header.request_id] = StageFailed(message, header.stream_id,
                                                        header.request_id, header.source_stage)
        elif header.kind == Kind.REPLY and payload is not None:
            del self._pending[header.request_id]
            self.stats.replies += 1
            reply = reply_from_frame(header, payload, pending.top_k, pending.vocab)
            reply.stamps = TimingStamps(header.timings, recv_ns, ready_ns, decode_ns,
                                        pending.start_ns, time.time_ns())
            reply.stage_ms = compute_ms(header.timings)
            self.timings.add(reply.stamps)
            self.figures.add_stamps(reply.stamps)
            self._done[header.request_id] = reply
        else:
            self.stats.unexpected += 1
            log.warning("dropped an unexpected %s frame on the reply pipe", header.kind.name)
        return True


def _wait_s(request_deadline: float, caller_deadline: float | None) -> float:
    """How long to block: until the request expires or the caller's deadline, if sooner."""
    left = max(0.0, request_deadline - time.monotonic())
    return left if caller_deadline is None else min(left, remaining(caller_deadline) or 0.0)
