"""Client side of a running coordinator: its status, and streamed generations."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

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
)
from controlplane.sockets import dealer_socket


class ClusterUnreachable(RuntimeError):
    """No usable status reply from the coordinator."""


def query_status(endpoint: str, timeout: float = 3.0,
                 curve: CurveClient | None = None) -> ClusterStatus:
    """One StatusRequest over a fresh DEALER; raise ClusterUnreachable on timeout or error."""
    ctx = zmq.Context()
    sock = dealer_socket(ctx, 64 << 20, f"status-{uuid.uuid4().hex[:12]}".encode())
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
        sock.send_multipart(to_frames(StatusRequest()))
        if not sock.poll(int(timeout * 1000)):
            raise ClusterUnreachable(f"no answer from a coordinator at {endpoint} within "
                                     f"{timeout:.1f}s: is it running (and is the address right)?")
        try:
            msg, _ = from_frames(sock.recv_multipart())
        except MessageError as exc:
            raise ClusterUnreachable(f"the coordinator at {endpoint} sent a bad reply: {exc}") \
                from None
        if isinstance(msg, Error):
            raise ClusterUnreachable(f"the coordinator at {endpoint} refused: {msg.detail}")
        if not isinstance(msg, StatusReply):
            raise ClusterUnreachable(f"the coordinator at {endpoint} answered {msg.TYPE}")
        return msg.status
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
    sock = dealer_socket(ctx, 16 << 20)
    try:
        sock.connect(endpoint)
        for request in requests:
            sock.send_multipart(to_frames(request))
        timeout = first_timeout
        while open_ids:
            if not sock.poll(int(timeout * 1000)):
                raise ClusterUnreachable(f"no answer from the generation service at {endpoint} "
                                         f"within {timeout:.0f}s")
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
        sock.close(0)
        ctx.term()


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
