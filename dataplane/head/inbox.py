"""The cluster head's inbox: the steps it has in flight, and their answers, filed by request
id until collected: the last stage's replies taken off the reply pipe, steps that outlive
the pipeline's timeout expired, and the answers of steps the head ran to the last stage
itself (a ``StageChain`` of every stage).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import zmq

from dataplane.head.errors import DataPlaneError, StageFailed, StageTimeout
from dataplane.head.metrics import StepMetrics
from dataplane.head.replies import ClusterReply, reply_from_frame
from dataplane.wire.frames import FrameError, HiddenStateFrame, Kind, ReplyMode, decode_frame
from dataplane.wire.reply_records import reply_payload
from dataplane.wire.timing import NS_PER_MS, StepTiming, TimingStamps, TimingWindow, compute_ms
from dataplane.wire.transport import (
    bound_endpoint,
    deadline_after,
    recv_parts,
    remaining,
    wait_readable,
)

log = logging.getLogger("zctl.dataplane.cluster")
IO_SLICE_S = 0.05  # the longest one wait on the reply pipe holds it (callers loop)


@dataclass
class ClusterStats:
    submitted: int = 0
    replies: int = 0
    stale_replies: int = 0  # answers of an old epoch or of abandoned requests
    malformed: int = 0
    unexpected: int = 0
    errors: int = 0
    timeouts: int = 0
    cancelled: int = 0  # steps cancelled (pipelined speculation's wrong guesses), answered
    # or not


@dataclass
class Pending:
    """A step in flight: whose it is, and how its answer is read."""

    stream_id: int
    epoch: int
    step: int
    mode: ReplyMode
    top_k: int
    vocab: int  # > 0: a top-k reply's dense log-probability rows are wanted (engine's step)
    start_ns: int
    deadline: float  # time.monotonic() past which it is expired


class ReplyInbox:
    """The requests a ClusterHead has in flight (``pending``) and the answers not yet taken
    (``done``: a ClusterReply, or the DataPlaneError the request failed with), by request id.

    It owns the reply pipe ``pull`` (bound by the head; ``reply_endpoint`` is the address
    the last stage sends to). The head gives it the chain's length and how long a step may
    take, what it counts and measures (``stats``, ``timings``, ``metrics``: the head's), and
    three callbacks: ``next_hop`` (stage 1's address, for the timeout's message), ``prefetch``
    (bind stage 0's likely next inputs of a stream while waiting) and ``broken`` (a stream's
    epoch failed: it must be reset). Its pipe is one thread's; ``close`` may come from
    another, once a wait in hand ends.
    """

    def __init__(self, pull: zmq.Socket, num_stages: int, timeout_s: float, stats: ClusterStats,
                 timings: TimingWindow, metrics: StepMetrics, *, next_hop: Callable[[], str],
                 prefetch: Callable[[int], object],
                 broken: Callable[[int, int, str], None]) -> None:
        self.pull = pull
        self.reply_endpoint = bound_endpoint(pull)
        self.num_stages, self.timeout_s = num_stages, timeout_s
        self.stats, self.timings, self.metrics = stats, timings, metrics
        self._next_hop, self._prefetch, self._broken = next_hop, prefetch, broken
        self.pending: dict[int, Pending] = {}
        self.done: dict[int, ClusterReply | DataPlaneError] = {}
        self.waiting_since = 0  # wall ns the current run of empty polls began (0: none)
        self._lock = threading.Lock()  # held while the pipe is used (against ``close``)
        self._closed = False
        # set by ``close`` before it waits for the lock: a waiter looping on the pipe gives
        # it up at its next slice (the lock is not fair: a loop re-taking it at once could
        # keep a closer waiting until the reply came)
        self._closing = threading.Event()

    def close(self) -> None:
        """Close the reply pipe (any thread); receiving afterwards raises DataPlaneError."""
        self._closing.set()
        with self._lock:
            self._closed = True
            self.pull.close(0)

    # -- what is in flight -----------------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        """Request ids submitted and not yet answered, oldest first."""
        return list(self.pending)

    def streams_in_flight(self) -> set[int]:
        return {p.stream_id for p in self.pending.values()}

    def expect(self, request_id: int, pending: Pending) -> None:
        """A step was sent: its answer is to come."""
        self.pending[request_id] = pending

    def forget_stream(self, stream_id: int) -> None:
        """The stream's requests in flight will never be collected (a new epoch)."""
        for rid in [r for r, p in self.pending.items() if p.stream_id == stream_id]:
            del self.pending[rid]

    def cancel(self, stream_id: int, request_ids: Iterable[int]) -> tuple[list[int], int]:
        """Forget these requests of the stream, in flight or answered: the steps of those in
        flight, and how many had an answer waiting."""
        steps, answered = [], 0
        for rid in request_ids:
            pending = self.pending.get(rid)
            if pending is not None and pending.stream_id == stream_id:
                steps.append(pending.step)
                del self.pending[rid]
            answered += self.done.pop(rid, None) is not None
        return steps, answered

    def abandon(self, why: str) -> None:
        """Fail every request in flight with ``why`` (its stream is broken)."""
        for rid in list(self.pending):
            pending = self.pending.pop(rid)
            self._broken(pending.stream_id, pending.epoch, why)
            self.done[rid] = DataPlaneError(f"request {rid} of stream {pending.stream_id} "
                                            f"abandoned: {why}")

    def clear(self) -> None:
        """Forget every request in flight and every answer not yet collected."""
        self.pending.clear()
        self.done.clear()

    # -- answers -----------------------------------------------------------------------------
    def collect(self, request_id: int, timeout_s: float | None = None) -> ClusterReply:
        """Wait for one request's answer (others arriving meanwhile are kept for later)."""
        if request_id not in self.done and request_id not in self.pending:
            raise DataPlaneError(f"request {request_id} is unknown, already collected, or was "
                                 "abandoned by a reset")
        deadline = deadline_after(timeout_s)
        while request_id not in self.done:
            pending = self.pending.get(request_id)
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
        while not self.done:
            if not self.pending:
                return None
            oldest = next(iter(self.pending))
            if time.monotonic() >= self.pending[oldest].deadline:
                self._expire(oldest)
                break
            if (not self._pump(_wait_s(self.pending[oldest].deadline, deadline))
                    and deadline is not None and time.monotonic() >= deadline):
                return None
        return self._take(next(iter(self.done)))

    def _take(self, request_id: int) -> ClusterReply:
        result = self.done.pop(request_id)
        if isinstance(result, DataPlaneError):
            raise result
        return result

    def _expire(self, request_id: int) -> None:
        pending = self.pending.pop(request_id)
        self.stats.timeouts += 1
        stages = tuple(range(1, self.num_stages))
        next_hop = self._next_hop()
        who = (f"stage 1 ({next_hop})" if len(stages) == 1 else
               f"one of stages 1-{stages[-1]} (first hop {next_hop})")
        message = (f"no answer for stream {pending.stream_id} step {pending.step} (request "
                   f"{request_id}) within {self.timeout_s:.1f} s: {who} did not answer; check "
                   f"that the workers run and the last stage sends to {self.reply_endpoint}")
        self._broken(pending.stream_id, pending.epoch, message)
        self.done[request_id] = StageTimeout(message, pending.stream_id, request_id, stages)

    def answer_here(self, header: HiddenStateFrame, logits: np.ndarray, top_k: int, vocab: int,
                    compute_ms: float, start_ns: int) -> int:
        """File the answer of a step whose last stage ran here: the payload a last stage would
        send (``reply_payload``), read as its reply would be, its timing (the stages' compute
        as stage 0's, no hop; ``start_ns``: the step's submit, wall clock) in the window as a
        reply's. Returns its request id."""
        payload = reply_payload(logits, header.reply, top_k)
        if header.reply == ReplyMode.LOGITS:
            payload = payload.copy()  # a view of the output tensor the next step overwrites
        reply = reply_from_frame(header, payload, top_k, vocab)
        rid = header.request_id
        reply.stage_ms = [compute_ms]
        self.metrics.add_stage_ms(reply.stage_ms)
        self.timings.add(StepTiming((compute_ms,), (), (time.time_ns() - start_ns) / NS_PER_MS,
                                    0.0))
        self.stats.submitted += 1
        self.stats.replies += 1
        self.done[rid] = reply
        return rid

    # -- receiving ---------------------------------------------------------------------------
    def _prefetch_in_flight(self) -> None:
        """While waiting for replies, bind stage 0's likely next inputs of every stream
        with a step in flight (StageRuntime.prefetch): off the critical path."""
        for pending in list(self.pending.values()):
            try:
                self._prefetch(pending.stream_id)
            except Exception as exc:  # a guess must never break a stream
                log.debug("stage 0 could not prefetch stream %s: %s", pending.stream_id, exc)

    def _pump(self, timeout_s: float | None) -> bool:
        """Wait up to timeout_s for one message from the last stage and file it.

        Back-to-back empty polls count as one wait: the reply's hop is ready since the
        first (else a slow hop's time would show as queueing behind the poll interval).
        """
        with self._lock:  # (in slices: a ``close`` from another thread waits one at most)
            if self._closed or self._closing.is_set():
                raise DataPlaneError("this pipeline was replaced (the cluster was re-wired)")
            if timeout_s != 0 and self.pending and not wait_readable(self.pull, 0):
                self._prefetch_in_flight()
                self.metrics.drain_when_idle()
            ready_ns = self.waiting_since or time.time_ns()
            wait_s = IO_SLICE_S if timeout_s is None else min(timeout_s, IO_SLICE_S)
            if not wait_readable(self.pull, wait_s):
                self.waiting_since = ready_ns
                return False
            try:
                parts = recv_parts(self.pull, zmq.NOBLOCK)
            except zmq.Again:
                return False
        recv_ns = time.time_ns()
        self.waiting_since = 0
        self.metrics.received_bytes += sum(map(len, parts))
        t0 = time.perf_counter_ns()
        try:
            header, payload = decode_frame(parts)
        except FrameError as exc:
            self.stats.malformed += 1
            log.warning("dropped a malformed reply: %s", exc)
            return True
        decode_ns = time.perf_counter_ns() - t0
        pending = self.pending.get(header.request_id)
        if (pending is None or pending.epoch != header.epoch
                or pending.stream_id != header.stream_id):
            self.stats.stale_replies += 1
            return True
        if header.kind == Kind.ERROR:
            del self.pending[header.request_id]
            self.stats.errors += 1
            message = (f"stream {header.stream_id} step {header.step} failed at "
                       f"{header.error or f'stage {header.source_stage}'}")
            self._broken(header.stream_id, header.epoch, message)
            self.done[header.request_id] = StageFailed(message, header.stream_id,
                                                       header.request_id, header.source_stage)
        elif header.kind == Kind.REPLY and payload is not None:
            del self.pending[header.request_id]
            self.stats.replies += 1
            reply = reply_from_frame(header, payload, pending.top_k, pending.vocab)
            reply.stamps = TimingStamps(header.timings, recv_ns, ready_ns, decode_ns,
                                        pending.start_ns, time.time_ns())
            reply.stage_ms = compute_ms(header.timings)
            self.timings.add(reply.stamps)
            self.metrics.add_stamps(reply.stamps)
            self.done[header.request_id] = reply
        else:
            self.stats.unexpected += 1
            log.warning("dropped an unexpected %s frame on the reply pipe", header.kind.name)
        return True


def _wait_s(request_deadline: float, caller_deadline: float | None) -> float:
    """How long to block: until the request expires or the caller's deadline, if sooner."""
    left = max(0.0, request_deadline - time.monotonic())
    return left if caller_deadline is None else min(left, remaining(caller_deadline) or 0.0)
