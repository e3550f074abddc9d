"""An emulated WAN link on a data-plane hop: one-way delay, jitter and a bandwidth cap.

There is no netem here, so latency is injected in our own link layer: a
``DelayedSender`` stands in for a hop's PUSH socket (``pipes.open_push`` returns one
when ``PipeOptions`` set ``delay_ms``, ``jitter_ms`` or ``rate_mbit``). ``send_parts``
copies the frame (the payload is often an OpenVINO output tensor the next inference
overwrites), gives it a due time and returns at once, so the sender's compute never
waits on the link. A small background thread owns the PUSH socket (ZeroMQ sockets stay
single-threaded: it is created, used and closed by that thread only) and sends each frame
when it is due, in order.

The link model, per frame of S bytes sent at time t:

    start = max(t, link_free)              # the link serialises one frame at a time
    link_free = start + 8 * S / rate       # only with a rate cap
    due = max(link_free + delay + U(0, jitter), previous due)   # FIFO: jitter never reorders

A relayed link (``relays`` > 0, e.g. a DERP relay between two sites) passes through that
many store-and-forward relays: each takes the whole frame in before it sends it on, over
its own leg at the same rate, after ``relay_delay_ms`` of its own. ``delay`` stays the
whole path's propagation, so a relay costs one more serialisation of the frame (8 S /
rate) plus its own delay: what makes big payloads (full logits) so slow over a relay.
``path_free`` is that part of the model, a pure function.

The sender stamps its timing record before handing the frame over, so the injected time
shows up as the hop's network time (``dataplane.wire.timing``). A frame the thread cannot
deliver (the peer gone for ``send_timeout_ms``) is dropped, counted and logged: as with
a real WAN, the coordinator's step timeout is what notices.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from dataplane.wire.frames import frame_bytes
from dataplane.wire.transport import PipeOptions, TransportError, push_socket, send_parts

log = logging.getLogger("zctl.dataplane.link")
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
SEND_SLICE_MS = 50  # a link thread's send waits this long at a time, then looks for a close


@dataclass
class LinkStats:
    """Counters of one shaped link (written by its sender thread; read any time)."""

    queued: int = 0  # frames accepted by send_parts
    sent: int = 0  # frames handed to the socket
    dropped: int = 0  # frames the socket would not take, or still queued at close
    max_backlog: int = 0  # most frames waiting at once
    max_late_ms: float = 0.0  # worst lateness of a send past its due time (scheduling)
    last_error: str = ""


def link_options(delay_ms: float = 0.0, jitter_ms: float = 0.0, rate_mbit: float = 0.0,
                 base: PipeOptions | None = None, relays: int = 0,
                 relay_delay_ms: float = 0.0) -> PipeOptions:
    """``base`` (default options) with a link shape; ValueError names a bad value."""
    from dataclasses import replace

    return replace(base or PipeOptions(), delay_ms=delay_ms, jitter_ms=jitter_ms,
                   rate_mbit=rate_mbit, relays=relays, relay_delay_ms=relay_delay_ms)


def path_free(legs_free: tuple[float, ...], now: float, serialise_s: float,
              relay_delay_s: float) -> tuple[float, ...]:
    """When each leg of a path is free again after a frame sent at ``now``: the sender's
    link first, then one leg per store-and-forward relay. A leg starts the frame once it
    is free and the frame is wholly in (a relay also waits its own ``relay_delay_s``) and
    takes ``serialise_s`` over it; the last leg's time is when the frame has left the
    last relay (the link's propagation delay comes on top)."""
    out = []
    ready = now
    for i, free in enumerate(legs_free):
        start = max(ready + (relay_delay_s if i else 0.0), free)
        ready = start + serialise_s
        out.append(ready)
    return tuple(out)


class DelayedSender:
    """A PUSH pipe to ``connect_addr`` whose frames arrive ``options.delay_ms`` (+ jitter,
    + size / rate) after they are sent. Use from one thread, like a socket.

    Raises TransportError at construction when the address is unusable, and from
    ``send_parts`` when ``options.hwm`` frames are already waiting for
    ``options.send_timeout_ms`` (the link is that far behind).
    """

    def __init__(self, ctx: zmq.Context, connect_addr: str, options: PipeOptions,
                 seed: int | None = None) -> None:
        self.address = connect_addr
        self.options = options
        self.stats = LinkStats()
        self._delay_s = options.delay_ms / 1e3
        self._jitter_s = options.jitter_ms / 1e3
        self._bit_s = 1.0 / (options.rate_mbit * 1e6) if options.rate_mbit else 0.0
        self._relay_delay_s = options.relay_delay_ms / 1e3
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, list[Any]]] = deque()
        self._legs_free = (0.0,) * (1 + options.relays)  # the link, then each relay's leg
        self._last_due = 0.0
        self._closing = False
        self._flush_until: float | None = None  # at close: send what is due before this
        self._open_error: TransportError | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ctx, started), daemon=True,
                                        name=f"zctl-link-{connect_addr}")
        self._thread.start()
        started.wait()
        if self._open_error is not None:
            self._thread.join()
            raise self._open_error

    # -- the sender's side -------------------------------------------------------------
    def send_parts(self, parts: list[Any]) -> None:
        """Queue a multipart frame (copied) to go out when due; returns at once."""
        frame = [bytes(p) for p in parts]  # the caller may reuse its buffers right away
        now = time.monotonic()
        with self._cond:
            if self._closing:
                raise TransportError(f"the link to {self.address} is closed")
            if len(self._queue) >= self.options.hwm:
                limit = now + self.options.send_timeout_ms / 1e3
                while len(self._queue) >= self.options.hwm and not self._closing:
                    left = limit - time.monotonic()
                    if left <= 0:
                        raise TransportError(
                            f"send to {self.address} timed out: {len(self._queue)} frames wait "
                            f"on the emulated link (delay {self.options.delay_ms:g} ms, rate "
                            f"{self.options.rate_mbit or 'unlimited'} Mbit/s, "
                            f"{self.options.relays} relays)")
                    self._cond.wait(left)
                now = time.monotonic()
            self._legs_free = path_free(self._legs_free, now,
                                        frame_bytes(frame) * 8 * self._bit_s,
                                        self._relay_delay_s)
            due = self._legs_free[-1] + self._delay_s
            if self._jitter_s:
                due += self._rng.uniform(0.0, self._jitter_s)
            due = max(due, self._last_due)
            self._last_due = due
            self._queue.append((due, frame))
            self.stats.queued += 1
            self.stats.max_backlog = max(self.stats.max_backlog, len(self._queue))
            self._cond.notify_all()

    @property
    def backlog(self) -> int:
        """Frames queued and not yet sent."""
        return len(self._queue)

    def close(self, linger: int = 0) -> None:
        """Stop the link; frames due within ``linger`` ms are still sent, the rest dropped."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._flush_until = time.monotonic() + max(0, linger) / 1e3
            self._cond.notify_all()
        self._thread.join(self.options.send_timeout_ms / 1e3 + max(0, linger) / 1e3 + 1.0)

    def __enter__(self) -> DelayedSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the link thread (owns the socket) ---------------------------------------------
    def _run(self, ctx: zmq.Context, started: threading.Event) -> None:
        if hasattr(signal, "pthread_sigmask"):  # SIGTERM/SIGINT must reach the main thread:
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # it may sit in a recv
        try:
            sock = push_socket(ctx, self.address, self.options)
        except TransportError as exc:
            self._open_error = exc
            started.set()
            return
        sock.setsockopt(zmq.SNDTIMEO, min(SEND_SLICE_MS, self.options.send_timeout_ms))
        started.set()
        try:
            while (frame := self._next_due()) is not None:
                try:
                    self._send(sock, frame)
                    self.stats.sent += 1
                except TransportError as exc:
                    self.stats.dropped += 1
                    self.stats.last_error = str(exc)
                    log.warning("emulated link to %s dropped a frame: %s", self.address, exc)
        finally:
            sock.close(0)

    def _send(self, sock: zmq.Socket, frame: list[Any]) -> None:
        """Send a frame, waiting up to the send timeout for a peer to take it, in slices,
        so that a closing link gives up at once: a re-wired stage's old link to a node
        that died must not hold the stage's restart a send timeout per frame queued."""
        limit = time.monotonic() + self.options.send_timeout_ms / 1e3
        while True:
            try:
                send_parts(sock, frame)
                return
            except TransportError:
                if self._closing or time.monotonic() >= limit:
                    raise

    def _next_due(self) -> list[Any] | None:
        """Block until the oldest frame is due and return it; None once the link closes."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._closing:
                    if not self._queue or self._queue[0][0] > (self._flush_until or 0.0):
                        self.stats.dropped += len(self._queue)
                        self._queue.clear()
                        return None
                if self._queue:
                    due, frame = self._queue[0]
                    if due <= now:
                        self._queue.popleft()
                        self.stats.max_late_ms = max(self.stats.max_late_ms, (now - due) * 1e3)
                        self._cond.notify_all()  # a sender may wait for room
                        return frame
                    self._cond.wait(due - now)
                else:
                    self._cond.wait()
