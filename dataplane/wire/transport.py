"""ZeroMQ plumbing for the data plane: PUSH/PULL pipes with bounded, non-hanging options.

Sockets only, no protocol: frames are lists of parts (see dataplane.wire.frames). Large
payloads are sent without copying, with a tracker so the sender knows when the
buffer (often an OpenVINO output tensor that the next inference overwrites) may be
reused; receives are zero-copy ``zmq.Frame`` parts.

With ``PipeOptions.curve`` the pipes are CURVE-encrypted and authenticated: a PULL is a
CURVE server that admits only the listed client keys (a ZAP handler on its context), a
PUSH connects with its node's key pair to the server key of the next hop.
"""

from __future__ import annotations

import errno
import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85


class TransportError(RuntimeError):
    """A pipe could not be opened, or a send could not be delivered in time."""


@dataclass(frozen=True)
class PipeCurve:
    """CURVE on the data pipes: this node's key pair (Z85), the public key of the next
    hop's PULL (what this node's PUSH connects to) and the client keys this node's PULL
    admits (the previous hop's)."""

    public: bytes
    secret: bytes
    peer: bytes = b""
    admit: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret),
                          *((("peer", self.peer),) if self.peer else ()),
                          *(("admit", k) for k in self.admit)):
            if not is_z85_key(key):
                raise ValueError(f"PipeCurve.{name} must be a 40-character Z85 CURVE key")


def is_z85_key(key: bytes) -> bool:
    """A Z85-encoded 32-byte CURVE key (40 characters)."""
    try:
        return isinstance(key, bytes) and len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


class ZapGate:
    """The ZAP handler of one context: each CURVE PULL socket (its own ZAP domain)
    admits the client keys listed for it. One per context (``gate_for``)."""

    def __init__(self, ctx: zmq.Context) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._keys: dict[str, frozenset[bytes]] = {}
        self._domains = itertools.count()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()

    def domain(self, keys: frozenset[bytes]) -> str:
        """A new ZAP domain admitting ``keys`` (set it on a socket before it binds)."""
        domain = f"zctl-data-{next(self._domains)}"
        self._keys[domain] = frozenset(keys)
        self._auth.configure_curve_callback(domain=domain, credentials_provider=self)
        return domain

    def callback(self, domain: str, key: bytes) -> bool:  # ZAP: the client's Z85 key
        return key in self._keys.get(domain, ())

    def stop(self) -> None:
        self._auth.stop()


_gates: dict[int, ZapGate] = {}
_gates_lock = threading.Lock()


def gate_for(ctx: zmq.Context) -> ZapGate:
    """The ZAP gate of ``ctx``, started on first use (stop it with ``close_gate``)."""
    with _gates_lock:
        gate = _gates.get(id(ctx))
        if gate is None:
            gate = _gates[id(ctx)] = ZapGate(ctx)
        return gate


def close_gate(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP gate, if it has one (before terminating the context)."""
    with _gates_lock:
        gate = _gates.pop(id(ctx), None)
    if gate is not None:
        gate.stop()


MAX_RELAYS = 4  # store-and-forward relays an emulated link may pass through
BIND_WAIT_S = 2.0  # how long a stage's pipe waits for its address to be free again


@dataclass(frozen=True)
class PipeOptions:
    """Socket options shared by every data-plane pipe (defaults suit a LAN)."""

    hwm: int = 64  # messages queued per pipe before sends block
    max_message_bytes: int = 1 << 31  # inbound parts above this drop the connection
    send_timeout_ms: int = 2000  # a send blocked this long (peer gone, queue full) fails
    zero_copy_bytes: int = zmq.COPY_THRESHOLD  # payloads at least this big are not copied
    keepalive_idle_s: int = 10
    keepalive_interval_s: int = 2
    keepalive_count: int = 3
    reconnect_ms: int = 100
    reconnect_max_ms: int = 2000
    # Injected link shape of the outbound pipe (see dataplane.wire.link); zeros: a plain pipe.
    delay_ms: float = 0.0  # one-way latency added to every outbound frame
    jitter_ms: float = 0.0  # plus a uniform random 0..jitter_ms (order is kept)
    rate_mbit: float = 0.0  # bandwidth cap: size / rate of serialisation delay (0: none)
    # Store-and-forward relays on the path (a DERP-like relay): each takes the whole frame
    # in before it sends it on at the link's rate, and adds relay_delay_ms of its own.
    relays: int = 0
    relay_delay_ms: float = 0.0
    curve: PipeCurve | None = None  # CURVE encryption and authentication (see PipeCurve)

    def __post_init__(self) -> None:
        for name, top in (("delay_ms", 60_000.0), ("jitter_ms", 60_000.0),
                          ("rate_mbit", 1e6), ("relay_delay_ms", 60_000.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or not 0 <= value <= top:
                raise ValueError(f"PipeOptions.{name} must be a number in 0..{top:g}, "
                                 f"got {value!r}")
        if isinstance(self.relays, bool) or not isinstance(self.relays, int) \
                or not 0 <= self.relays <= MAX_RELAYS:
            raise ValueError(f"PipeOptions.relays must be an integer in 0..{MAX_RELAYS}, "
                             f"got {self.relays!r}")
        if self.hwm < 1:
            raise ValueError(f"PipeOptions.hwm must be >= 1, got {self.hwm!r}")

    @property
    def shaped(self) -> bool:
        """True when outbound frames go through a DelayedSender (some link shape is set)."""
        return bool(self.delay_ms or self.jitter_ms or self.rate_mbit or self.relays)


DEFAULT_OPTIONS = PipeOptions()


def _common(sock: zmq.Socket, options: PipeOptions) -> None:
    sock.copy_threshold = options.zero_copy_bytes  # pyzmq copies smaller parts anyway
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, options.keepalive_idle_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, options.keepalive_interval_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, options.keepalive_count)


def curve_server(sock: zmq.Socket, public: bytes, secret: bytes, zap_domain: str = "") -> None:
    """Make ``sock`` a CURVE server with this keypair (before it binds); ``zap_domain``
    picks the ZAP handler that admits its peers. Both planes set CURVE up here."""
    if zap_domain:
        sock.zap_domain = zap_domain.encode()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(sock: zmq.Socket, server_public: bytes, public: bytes, secret: bytes) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public`` (before it connects)."""
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def pull_socket(ctx: zmq.Context, bind_addr: str,
                options: PipeOptions = DEFAULT_OPTIONS) -> zmq.Socket:
    """A PULL socket bound to ``bind_addr`` (``tcp://host:*`` picks a free port)."""
    sock = ctx.socket(zmq.PULL)
    _common(sock, options)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
    if options.curve is not None:
        curve_server(sock, options.curve.public, options.curve.secret,
                     gate_for(ctx).domain(options.curve.admit))
    try:
        bind_when_free(sock, bind_addr)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise TransportError(f"cannot bind {bind_addr}: {exc}") from None
    return sock


def bind_when_free(sock: zmq.Socket, addr: str, wait_s: float = BIND_WAIT_S) -> None:
    """Bind ``sock`` to ``addr``, waiting up to ``wait_s`` while the address is in use: a
    stage relaunched on its address (a re-wiring) binds right after the last one's socket
    closed, and ZeroMQ releases a closed socket's port a moment later, in its I/O thread.
    Raises the ZMQError when it stays in use, or on any other error."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def push_socket(ctx: zmq.Context, connect_addr: str,
                options: PipeOptions = DEFAULT_OPTIONS) -> zmq.Socket:
    """A PUSH socket connected to ``connect_addr``; messages queue only on live connections."""
    sock = ctx.socket(zmq.PUSH)
    _common(sock, options)
    sock.setsockopt(zmq.SNDHWM, options.hwm)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDTIMEO, options.send_timeout_ms)
    sock.setsockopt(zmq.RECONNECT_IVL, options.reconnect_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, options.reconnect_max_ms)
    if options.curve is not None:
        if not options.curve.peer:
            sock.close(0)
            raise TransportError(f"CURVE is on but the public key of {connect_addr} is unknown")
        curve_client(sock, options.curve.peer, options.curve.public, options.curve.secret)
    try:
        sock.connect(connect_addr)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise TransportError(f"cannot connect to {connect_addr}: {exc}") from None
    return sock


def bound_endpoint(sock: zmq.Socket) -> str:
    """The address a bound socket actually listens on (resolves ``*`` ports)."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def send_parts(sock: zmq.Socket, parts: Sequence[Any]) -> zmq.MessageTracker | None:
    """Send a multipart message; the last part (the payload) is not copied when large.

    Parts before the last are copied; the last is sent zero-copy when it reaches the
    socket's ``copy_threshold`` (PipeOptions.zero_copy_bytes). The returned tracker
    says when its buffer may be modified again (``tracker.done``). Raises
    TransportError when the send times out. A DelayedSender (a shaped link) queues the
    frame instead and returns None.
    """
    if not isinstance(sock, zmq.Socket):
        return sock.send_parts(parts)
    try:
        for part in parts[:-1]:
            sock.send(part, zmq.SNDMORE)
        return sock.send(parts[-1], 0, copy=False, track=True)
    except zmq.Again:
        raise TransportError(f"send to {peer_name(sock)} timed out: no live peer or its queue "
                             "is full") from None


def recv_parts(sock: zmq.Socket, flags: int = 0) -> list[Any]:
    """Receive one multipart message: the first part as bytes, the rest as zero-copy Frames.

    Raises ``zmq.Again`` with NOBLOCK when nothing is waiting.
    """
    parts: list[Any] = [sock.recv(flags)]
    while sock.getsockopt(zmq.RCVMORE):  # not ``sock.rcvmore``: attribute options are slow
        parts.append(sock.recv(0, copy=False))
    return parts


def peer_name(sock: zmq.Socket) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) and endpoint else "the next hop"


class BufferGuard:
    """Keeps a stream's zero-copy send from being overwritten by its next inference.

    ``hold(key, tracker)`` after sending a buffer owned by ``key``; ``release(key)``
    before reusing that buffer waits (bounded) until libzmq no longer needs it.
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._held: dict[int, zmq.MessageTracker] = {}

    def hold(self, key: int, tracker: zmq.MessageTracker | None) -> None:
        if tracker is not None and not tracker.done:
            self._held[key] = tracker

    def release(self, key: int) -> None:
        tracker = self._held.pop(key, None)
        if tracker is None or tracker.done:
            return
        try:
            tracker.wait(self.timeout_s)
        except zmq.NotDone:
            raise TransportError(f"a zero-copy send of stream {key} is still pending after "
                                 f"{self.timeout_s:.1f} s") from None

    def forget(self, key: int) -> None:
        self._held.pop(key, None)


def wait_readable(sock: zmq.Socket, timeout_s: float | None) -> bool:
    """Block (in the kernel, not spinning) until ``sock`` has a message or the timeout passes.

    Calls zmq_poll directly: ``Socket.poll`` builds a Poller per call, which costs more
    than the wait itself on the per-token path.
    """
    timeout_ms = -1 if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
    return bool(zmq.zmq_poll([(sock, zmq.POLLIN)], timeout_ms))


def deadline_after(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
