"""The generation service's synchronous client: streamed generations and the service's
stats, over a DEALER of its own (``zctl run``, the tests and the benchmarks; the HTTP
server uses ``zctl.service.async_client``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import zmq

from controlplane.messages import Error, MessageError, from_frames, to_frames, type_tag
from controlplane.sockets import dealer_socket, disconnect_monitor, was_disconnected
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.service.errors import ServiceUnavailable, lost_service
from zctl.service.messages import (
    GenerateCancel,
    GenerationEvent,
    ServiceStats,
    ServiceStatsRequest,
)


def query_service_stats(endpoint: str, timeout: float = 3.0) -> ServiceStats:
    """One ServiceStatsRequest to the generation service at ``endpoint`` (its ROUTER, the
    one generations use) over a fresh DEALER; raise ServiceUnavailable on timeout or error."""
    ctx = zmq.Context()
    sock = dealer_socket(ctx, 16 << 20, f"stats-{uuid.uuid4().hex[:12]}".encode())
    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ServiceUnavailable(f"{endpoint!r} is not a generation service address "
                                     f"(tcp://HOST:PORT): {exc}") from None
        sock.send_multipart(to_frames(ServiceStatsRequest()))
        if not sock.poll(int(timeout * 1000)):
            raise ServiceUnavailable(f"no answer from the generation service at {endpoint} "
                                     f"within {timeout:.1f}s: is it running (and is the "
                                     "address right)?")
        try:
            msg, _ = from_frames(sock.recv_multipart())
        except MessageError as exc:
            raise ServiceUnavailable(f"bad answer from {endpoint}: {exc}") from None
        if isinstance(msg, Error):
            raise ServiceUnavailable(f"the generation service at {endpoint} refused: "
                                     f"{msg.detail}")
        if not isinstance(msg, ServiceStats):
            raise ServiceUnavailable(f"the generation service at {endpoint} answered {type_tag(msg)}")
        return msg
    finally:
        sock.close(0)
        ctx.term()


def generate_stream(endpoint: str, request: GenerationRequest, first_timeout: float = 120.0,
                    idle_timeout: float = 60.0) -> Iterator[GenerationEvent]:
    """Send a GenerationRequest and yield its chunks, ending with the GenerationDone.

    ``first_timeout`` bounds the wait for the first answer (prefill, a cold pipeline);
    ``idle_timeout`` bounds every later gap. Raises ServiceUnavailable on silence or error.
    """
    yield from generate_many(endpoint, [request], first_timeout, idle_timeout)


def generate_many(endpoint: str, requests: list[GenerationRequest],
                  first_timeout: float = 120.0, idle_timeout: float = 60.0,
                  ) -> Iterator[GenerationEvent]:
    """Send several GenerationRequests at once (the service runs them concurrently) and yield
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
                raise ServiceUnavailable(f"no answer from the generation service at {endpoint} "
                                         f"within {timeout:.0f}s")
            if monitor in ready and was_disconnected(monitor.recv_multipart()):
                raise ServiceUnavailable(lost_service(endpoint, len(open_ids)))
            if sock not in ready:
                continue
            timeout = idle_timeout
            try:
                msg, _ = from_frames(sock.recv_multipart())
            except MessageError as exc:
                raise ServiceUnavailable(f"bad answer from {endpoint}: {exc}") from None
            if isinstance(msg, Error):
                raise ServiceUnavailable(f"the generation service refused: {msg.detail}")
            if isinstance(msg, GenerationEvent) and msg.request_id in open_ids:
                if isinstance(msg, GenerationDone):
                    open_ids.discard(msg.request_id)
                yield msg
    finally:
        cancel_open(sock, open_ids)
        sock.disable_monitor()
        monitor.close(0)
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
