"""Client side of a running coordinator's control plane: its status snapshot."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import zmq

from controlplane.messages import (
    Error,
    MessageError,
    StatusReply,
    StatusRequest,
    from_frames,
    to_frames,
    type_tag,
)
from controlplane.records import ClusterStatus
from controlplane.security import CurveClient
from controlplane.sockets import dealer_socket


class ClusterUnreachable(RuntimeError):
    """No usable status reply from the coordinator."""


def query_status(endpoint: str, timeout: float = 3.0,
                 curve: CurveClient | None = None) -> ClusterStatus:
    """One StatusRequest over a fresh DEALER; raise ClusterUnreachable on timeout or error."""
    return query_status_timed(endpoint, timeout, curve, samples=1).status


@dataclass(frozen=True)
class TimedStatus:
    """A status reply and when its request went out and its answer came back (this
    machine's wall clock), from the round trip that took least time."""

    status: ClusterStatus
    sent: float
    received: float
    rtt_s: float


def query_status_timed(endpoint: str, timeout: float = 3.0, curve: CurveClient | None = None,
                       samples: int = 3) -> TimedStatus:
    """Up to ``samples`` StatusRequests over one DEALER, all within ``timeout``; the one
    that took least time (the first also pays for the connection). ClusterUnreachable if
    none is answered, or on a bad address or reply."""
    ctx = zmq.Context()
    sock = dealer_socket(ctx, 64 << 20, f"status-{uuid.uuid4().hex[:12]}".encode())
    deadline = time.monotonic() + timeout
    best: TimedStatus | None = None
    try:
        if curve is not None:
            curve.apply(sock)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ClusterUnreachable(f"{endpoint!r} is not a coordinator address "
                                     f"(tcp://HOST:PORT): {exc}") from None
        for _ in range(max(1, samples)):
            sent, start = time.time(), time.perf_counter()
            sock.send_multipart(to_frames(StatusRequest()))
            wait = deadline - time.monotonic()
            if wait <= 0 or not sock.poll(int(wait * 1000)):
                if best is not None:
                    break
                raise ClusterUnreachable(f"no answer from a coordinator at {endpoint} within "
                                         f"{timeout:.1f}s: is it running (and is the address "
                                         "right)?")
            status = _status_reply(endpoint, sock.recv_multipart())
            sample = TimedStatus(status, sent, time.time(), time.perf_counter() - start)
            if best is None or sample.rtt_s < best.rtt_s:
                best = sample
        assert best is not None
        return best
    finally:
        sock.close(0)
        ctx.term()


def _status_reply(endpoint: str, frames: list[bytes]) -> ClusterStatus:
    try:
        msg, _ = from_frames(frames)
    except MessageError as exc:
        raise ClusterUnreachable(f"the coordinator at {endpoint} sent a bad reply: {exc}") \
            from None
    if isinstance(msg, Error):
        raise ClusterUnreachable(f"the coordinator at {endpoint} refused: {msg.detail}")
    if not isinstance(msg, StatusReply):
        raise ClusterUnreachable(f"the coordinator at {endpoint} answered {type_tag(msg)}")
    return msg.status
