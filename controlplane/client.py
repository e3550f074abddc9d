"""Client side of a running coordinator: its status, streamed generations, and the
generation service's stats."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import zmq

from controlplane.messages import (
    Error,
    MessageError,
    StatusReply,
    StatusRequest,
    from_frames,
    to_frames,
)
from controlplane.records import ClusterStatus
from controlplane.security import CurveClient
from controlplane.service_messages import (
    GenerateCancel,
    GenerateChunk,
    GenerateDone,
    GenerateRequest,
    ServiceStats,
    ServiceStatsRequest,
)
from controlplane.sockets import dealer_socket, disconnect_monitor, was_disconnected


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
        raise ClusterUnreachable(f"the coordinator at {endpoint} answered {msg.TYPE}")
    return msg.status


def query_service_stats(endpoint: str, timeout: float = 3.0) -> ServiceStats:
    """One ServiceStatsRequest to the generation service at ``endpoint`` (its ROUTER, the
    one generations use) over a fresh DEALER; raise ClusterUnreachable on timeout or error."""
    ctx = zmq.Context()
    sock = dealer_socket(ctx, 16 << 20, f"stats-{uuid.uuid4().hex[:12]}".encode())
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ClusterUnreachable(f"{endpoint!r} is not a generation service address "
                                     f"(tcp://HOST:PORT): {exc}") from None
        sock.send_multipart(to_frames(ServiceStatsRequest()))
        if not sock.poll(int(timeout * 1000)):
            raise ClusterUnreachable(f"no answer from the generation service at {endpoint} "
                                     f"within {timeout:.1f}s: is it running (and is the "
                                     "address right)?")
        try:
            msg, _ = from_frames(sock.recv_multipart())
        except MessageError as exc:
            raise ClusterUnreachable(f"bad answer from {endpoint}: {exc}") from None
        if isinstance(msg, Error):
            raise ClusterUnreachable(f"the generation service at {endpoint} refused: "
                                     f"{msg.detail}")
        if not isinstance(msg, ServiceStats):
            raise ClusterUnreachable(f"the generation service at {endpoint} answered {msg.TYPE}")
        return msg
    finally:
        sock.close(0)
        ctx.term()


def generate_stream(endpoint: str, request: GenerateRequest, first_timeout: float = 120.0,
                    idle_timeout: float = 60.0) -> Iterator[GenerateChunk | GenerateDone]:
    """Send a GenerateRequest and yield its chunks, ending with the GenerateDone.

    ``first_timeout`` bounds the wait for the first answer (prefill, a cold pipeline);
    ``idle_timeout`` bounds every later gap. Raises ClusterUnreachable on silence or error.
    """
    yield from generate_many(endpoint, [request], first_timeout, idle_timeout)


def generate_many(endpoint: str, requests: list[GenerateRequest], first_timeout: float = 120.0,
                  idle_timeout: float = 60.0) -> Iterator[GenerateChunk | GenerateDone]:
    """Send several GenerateRequests at once (the service runs them concurrently) and yield
    every chunk and done as it arrives, until each request is done. Stopped early (Ctrl-C,
    the generator closed, an error), it cancels the generations still running."""
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique")
    open_ids = {r.request_id for r in requests}
    ctx = zmq.Context()
    sock = dealer_socket(ctx, 16 << 20, ping=True)
    monitor = disconnect_monitor(sock)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    try:
        sock.connect(endpoint)
        for request in requests:
            sock.send_multipart(to_frames(request))
        timeout = first_timeout
        while open_ids:
            ready = dict(poller.poll(int(timeout * 1000)))
            if not ready:
                raise ClusterUnreachable(f"no answer from the generation service at {endpoint} "
                                         f"within {timeout:.0f}s")
            if monitor in ready and was_disconnected(monitor.recv_multipart()):
                raise ClusterUnreachable(lost_service(endpoint, len(open_ids)))
            if sock not in ready:
                continue
            timeout = idle_timeout
            try:
                msg, _ = from_frames(sock.recv_multipart())
            except MessageError as exc:
                raise ClusterUnreachable(f"bad answer from {endpoint}: {exc}") from None
            if isinstance(msg, Error):
                raise ClusterUnreachable(f"the generation service refused: {msg.detail}")
            if isinstance(msg, GenerateChunk | GenerateDone) and msg.request_id in open_ids:
                if isinstance(msg, GenerateDone):
                    open_ids.discard(msg.request_id)
                yield msg
    finally:
        cancel_open(sock, open_ids)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def lost_service(endpoint: str, running: int) -> str:
    """What a client is told when its connection to the generation service breaks: the
    service's process ended (its coordinator stopped, crashed or restarted) or its machine
    went silent, and a service keeps no generation across a restart."""
    return (f"the generation service at {endpoint} went away (its coordinator stopped or "
            f"restarted, or its machine went silent): {running} generation(s) in flight "
            "lost; send them again once the cluster serves (zctl cluster status)")


def cancel_open(sock: zmq.Socket, request_ids: set[str], linger_ms: int = 500) -> None:
    """Ask the service to cancel these generations, giving the messages ``linger_ms`` to
    leave before the socket closes."""
    if not request_ids:
        return
    sock.setsockopt(zmq.LINGER, linger_ms)
    for request_id in sorted(request_ids):
        try:
            sock.send_multipart(to_frames(GenerateCancel(request_id)), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
