"""The HTTP server's link to the coordinator's generation service, on the event loop.

``AsyncServiceClient`` owns one ZeroMQ DEALER (``zmq.asyncio``) to the service's ROUTER: the
requests of every HTTP client go out on it, and one reader task hands each answer to the
queue of the request it belongs to. ``generate`` yields a request's chunks and its end;
leaving it early (a client that disconnects, a stream closed) sends ``GenerateCancel``,
so the generation stops and frees the stages. The service's silence beyond the timeouts
ends a request with ``ServiceUnavailable``, and so does, at once, a broken connection (the
coordinator stopped or restarted: its generations are gone); the DEALER reconnects by
itself, so requests after a coordinator's restart are served again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from controlplane.messages import Error, MessageError, from_frames, to_frames
from controlplane.sockets import dealer_socket, disconnect_monitor, was_disconnected
from zctl.engine.requests import GenerationDone, GenerationRequest
from zctl.service.errors import ServiceUnavailable, lost_service
from zctl.service.messages import (
    DetokenizeRequest,
    GenerateCancel,
    GenerationEvent,
    ServiceStats,
    ServiceStatsRequest,
    TokenizeRequest,
    TokensReply,
)

log = logging.getLogger("zctl.serve")
MAX_ANSWER_BYTES = 64 << 20
FIRST_TIMEOUT_S = 300.0  # a request's first answer (a queue, a prefill, a paused pipeline)
IDLE_TIMEOUT_S = 60.0  # any later gap (paused generations hear a note every 10 s)
STATS_TIMEOUT_S = 3.0
TOKENS_TIMEOUT_S = 10.0  # a tokenize answer (the service answers between its steps)


class AsyncServiceClient:
    """Generations and stats from the generation service at ``endpoint``."""

    def __init__(self, endpoint: str, first_timeout_s: float = FIRST_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.first_timeout_s, self.idle_timeout_s = first_timeout_s, idle_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock: Any = None
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue[GenerationEvent | ServiceUnavailable]] = {}
        self._stats_waiters: list[asyncio.Future[ServiceStats | Error]] = []
        self._token_waiters: dict[str, asyncio.Future[TokensReply]] = {}  # by request id

    def _socket(self) -> Any:
        if self._sock is None:
            self._sock = dealer_socket(self._ctx, MAX_ANSWER_BYTES,
                                       f"serve-{uuid.uuid4().hex[:12]}".encode(), ping=True)
            monitor = disconnect_monitor(self._sock)
            self._sock.connect(self.endpoint)
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(self._read())
            self._watcher = loop.create_task(self._watch(monitor))
        return self._sock

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
        self._ctx.term()

    async def _watch(self, monitor: Any) -> None:
        """End every request in flight when the connection to the service breaks."""
        try:
            while True:
                if was_disconnected(await monitor.recv_multipart()):
                    lost = ServiceUnavailable(lost_service(self.endpoint, len(self._queues)))
                    log.warning("%s", lost)
                    for queue in self._queues.values():
                        queue.put_nowait(lost)
                    for waiter in self._token_waiters.values():
                        if not waiter.done():
                            waiter.set_exception(lost)
        finally:
            monitor.close(0)

    async def _read(self) -> None:
        """Hand every answer to whoever waits for it."""
        while True:
            frames = await self._sock.recv_multipart()
            # the receive does not yield while answers are waiting: yield here, or a fast
            # model's stream of answers keeps every other task (new requests among them)
            # waiting until it stops
            await asyncio.sleep(0)
            try:
                msg, _ = from_frames(frames)
            except MessageError as exc:
                log.warning("bad answer from the generation service: %s", exc)
                continue
            if isinstance(msg, GenerationEvent):
                queue = self._queues.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, TokensReply):
                waiter = self._token_waiters.get(msg.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            elif isinstance(msg, ServiceStats | Error):
                waiters, self._stats_waiters = self._stats_waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(msg)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """The request's chunks, then its GenerationDone."""
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request {rid} is already running")
        queue: asyncio.Queue[GenerationEvent | ServiceUnavailable] = asyncio.Queue()
        self._queues[rid] = queue
        sock = self._socket()
        finished = False
        try:
            await sock.send_multipart(to_frames(request))
            timeout = self.first_timeout_s
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    raise ServiceUnavailable(
                        f"the generation service at {self.endpoint} sent nothing for "
                        f"{timeout:.0f} s") from None
                if isinstance(msg, ServiceUnavailable):
                    finished = True  # nothing to cancel: the service that ran it is gone
                    raise msg
                timeout = self.idle_timeout_s
                finished = isinstance(msg, GenerationDone)
                yield msg
                if finished:
                    return
        finally:
            del self._queues[rid]
            if not finished:  # the caller left early: stop the generation
                with contextlib.suppress(zmq.ZMQError):
                    sent = sock.send_multipart(to_frames(GenerateCancel(rid)), zmq.NOBLOCK)
                    # (a future: a cancel that cannot go, the client closing, fails in it)
                    sent.add_done_callback(_unsent_cancel)

    async def stats(self, timeout_s: float = STATS_TIMEOUT_S) -> ServiceStats:
        """The service's figures now (ServiceUnavailable if it does not answer)."""
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        await self._socket().send_multipart(to_frames(ServiceStatsRequest()))
        try:
            msg = await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"the generation service at {self.endpoint} does not "
                                     f"answer (waited {timeout_s:g} s)") from None
        finally:
            if waiter in self._stats_waiters:
                self._stats_waiters.remove(waiter)
        if isinstance(msg, Error):
            raise ServiceUnavailable(f"the generation service refused: {msg.detail}")
        return msg

    async def tokens(self, request: TokenizeRequest | DetokenizeRequest,
                     timeout_s: float = TOKENS_TIMEOUT_S) -> TokensReply:
        """The service's answer to a tokenize or detokenize request (ServiceUnavailable if
        it does not answer)."""
        rid = request.request_id
        if rid in self._token_waiters:
            raise ValueError(f"request {rid} is already waiting")
        waiter = self._token_waiters[rid] = asyncio.get_running_loop().create_future()
        try:
            await self._socket().send_multipart(to_frames(request))
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"the generation service at {self.endpoint} does not "
                                     f"answer (waited {timeout_s:g} s)") from None
        finally:
            del self._token_waiters[rid]


def _unsent_cancel(sent: asyncio.Future[Any]) -> None:
    """Take a cancel's send failure (the client or its socket closing as the server stops):
    its generation ends with the service anyway, and nothing reports an error no one
    awaits."""
    if not sent.cancelled() and sent.exception() is not None:
        log.debug("a cancel was not sent: %s", sent.exception())
