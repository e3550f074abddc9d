"""How the live fuzzer (tools.robustness.fuzz) puts hostile messages on each kind of socket:
a DEALER to a ROUTER (answers counted), a PUSH to a PULL (which never answers), raw
ZMTP over TCP (a greeting, then a frame whose length field is huge), HTTP requests, and
CURVE probes that must get nowhere."""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tools.robustness.fuzz_messages import HttpCase, Parts

FRESH_SOCKET_EVERY = 500  # a new client socket (a new peer to the listener) this often
BATCH = 50  # messages between looks for answers
SEND_TIMEOUT_MS = 5000  # a listener that stops reading for this long counts as stalled


@dataclass
class Tally:
    """What one socket's fuzzing sent and got back."""

    messages: int = 0
    replies: int = 0
    over_cap: int = 0  # messages just over the socket's cap (or a huge length field)
    stalled: int = 0  # sends that waited SEND_TIMEOUT_MS (the listener stopped reading)
    statuses: Counter = field(default_factory=Counter)  # HTTP: answers by status code
    failures: Counter = field(default_factory=Counter)  # HTTP: no answer, by exception


def endpoint_host_port(address: str) -> tuple[str, int]:
    """tcp://HOST:PORT or http://HOST:PORT -> (HOST, PORT)."""
    host, _, port = address.split("://", 1)[1].rstrip("/").rpartition(":")
    return host, int(port)


def _client(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    return sock


def _drain(sock: zmq.Socket, wait_ms: int = 0) -> int:
    answers = 0
    while sock.poll(wait_ms):
        sock.recv_multipart()
        answers += 1
        wait_ms = min(wait_ms, 50)
    return answers


def fuzz_zmq(address: str, kind: int, count: int, make: Callable[[], Parts],
             over_cap: Callable[[], Parts] | None, over_count: int) -> Tally:
    """``count`` messages from ``make`` (and ``over_count`` from ``over_cap``, each on a
    peer of its own, which the listener drops) to ``address`` from a DEALER or a PUSH."""
    tally = Tally()
    ctx = zmq.Context()
    answers = kind == zmq.DEALER
    sock = _client(ctx, kind, address)
    try:
        for i in range(count):
            if i and i % FRESH_SOCKET_EVERY == 0:
                tally.replies += _drain(sock, 200) if answers else 0
                sock.close(0)
                sock = _client(ctx, kind, address)
            parts = make() or [b""]
            try:
                sock.send_multipart(parts)
            except zmq.Again:
                tally.stalled += 1
            tally.messages += 1
            if answers and i % BATCH == BATCH - 1:
                tally.replies += _drain(sock)
        tally.replies += _drain(sock, 1000) if answers else 0
        for _ in range(over_count if over_cap else 0):
            big = _client(ctx, kind, address)
            try:
                big.send_multipart(over_cap())
                tally.over_cap += 1
                tally.replies += _drain(big, 300) if answers else 0
            except zmq.Again:
                tally.stalled += 1
            finally:
                big.close(0)
    finally:
        sock.close(0)
        ctx.term()
    return tally


# -- raw ZMTP --------------------------------------------------------------------------------

def zmtp_greeting(socket_type: str) -> bytes:
    """A ZMTP 3.0 greeting (NULL mechanism) and READY command of a ``socket_type`` peer."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + \
        b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type.encode()
    ready = b"\x05READY" + prop
    return greeting + b"\x04" + bytes([len(ready)]) + ready


def huge_frame(size: int) -> bytes:
    """A message frame's head (long form) saying ``size`` bytes follow, and a few of them."""
    return b"\x02" + struct.pack(">Q", size) + b"\0" * 64


def zmtp_dropped(address: str, socket_type: str, size: int, timeout_s: float = 5.0) -> bool:
    """Whether a listener closes the connection of a peer that announces a ``size``-byte
    frame (over its MAXMSGSIZE) within ``timeout_s``."""
    host, port = endpoint_host_port(address)
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError:
        return False  # nothing listens there any more
    with conn:
        try:
            conn.sendall(zmtp_greeting(socket_type) + huge_frame(size))
        except OSError:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if not conn.recv(4096):
                    return True  # closed by the listener
            except TimeoutError:
                return False
            except OSError:
                return True
    return False


# -- HTTP ------------------------------------------------------------------------------------

def fuzz_http(base_url: str, count: int, make: Callable[[], HttpCase],
              over_cap: Callable[[], HttpCase], over_count: int) -> Tally:
    """``count`` requests from ``make`` and ``over_count`` bodies over the API's limit."""
    import httpx

    tally = Tally()
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        for i in range(count + over_count):
            case = make() if i < count else over_cap()
            try:
                answer = client.request(case.method, case.path, headers=case.headers,
                                        content=case.body)
                tally.statuses[answer.status_code] += 1
                tally.replies += 1
            except httpx.HTTPError as exc:  # a ReadTimeout: no answer within 60 s
                tally.failures[type(exc).__name__] += 1
            tally.messages += i < count
            tally.over_cap += i >= count
    return tally


# -- CURVE -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    """What a client the listener must not admit got: answers and finished handshakes."""

    replies: int
    handshakes: int
    refusals: int  # handshakes the listener failed (auth or mechanism)


def curve_probe(address: str, kind: int, frames: list[Parts], server_key: bytes | None,
                wait_s: float = 3.0) -> Probe:
    """Send ``frames`` to a CURVE listener from a fresh key pair (``server_key``: the
    listener's real public key) or in plain text (None); count what came back."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 200)
    monitor = sock.get_monitor_socket()
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            server_key, public, secret)
    replies = handshakes = refusals = 0
    try:
        sock.connect(address)
        for parts in frames:
            try:
                sock.send_multipart(parts)
            except zmq.Again:
                pass  # never connected: nothing to queue on
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if kind == zmq.DEALER and sock.poll(50):
                sock.recv_multipart()
                replies += 1
            while monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                handshakes += event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                refusals += event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                                      zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            time.sleep(0.02)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()
    return Probe(replies, handshakes, refusals)


def seeded(seed: int, name: str) -> random.Random:
    """The generator of one socket's messages: the run's seed and the socket's name."""
    return random.Random(f"{seed}:{name}")


def jsonable(tally: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": tally.messages, "replies": tally.replies,
                           "over_cap": tally.over_cap, "stalled": tally.stalled}
    if tally.statuses or tally.failures:
        out["statuses"] = {str(k): v for k, v in sorted(tally.statuses.items())}
        out["failures"] = dict(tally.failures)
    return out
