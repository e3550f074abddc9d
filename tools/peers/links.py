"""The check that both systems' hops add the same delay: the one-way delay zctl's link
layer adds to a data-plane frame (a PUSH through dataplane.wire.link's DelayedSender
against a plain one), and half the round trip a relay process adds in front of an echo
server (against the round trip straight to it), each the median of many messages. A relay
that fails is the check's failure, with its log, not the run's."""

from __future__ import annotations

import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tools.peers.processes import PeerFailure, log_says, spawn, wait_until
from tools.peers.relay import READY
from zctl.launcher.local import free_port, log_tail, stop_processes

MESSAGES = 40
TOLERANCE_MS = 1.0  # plus 10% of the delay: what counts as the same delay


@contextmanager
def echo_server(host: str) -> Iterator[int]:
    """A TCP echo server on ``host`` (one connection at a time) in a thread: its port."""
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        listener.close()


def round_trip_ms(host: str, port: int, messages: int = MESSAGES) -> float:
    """The median round trip of a 64-byte message to an echo server at host:port."""
    times = []
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(messages):
            start = time.perf_counter()
            conn.sendall(b"x" * 64)
            got = 0
            while got < 64:
                data = conn.recv(64 - got)
                if not data:
                    raise ConnectionError(f"{host}:{port} closed the connection")
                got += len(data)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def relay_one_way_ms(delay_ms: float, host: str, logs: Path) -> dict[str, float]:
    """Half the round trip a relay process (as the benchmark starts it) with ``delay_ms``
    adds, measured against an echo server on ``host``. PeerFailure (with the relay's
    log's tail) if the relay does not start, exits, or breaks the connection."""
    with echo_server(host) as port:
        direct = round_trip_ms(host, port)
        relay_port = free_port(host)
        log = logs / "relay-check.log"
        relay = spawn("the relay check", [sys.executable, "-m", "tools.peers.relay",
                                          f"{host}:{relay_port}", f"{host}:{port}",
                                          f"{delay_ms:g}"], log, env={"PYTHONUNBUFFERED": "1"})
        try:
            wait_until(lambda: log_says(log, READY), [relay], "the relay", 60)
            relayed = round_trip_ms(host, relay_port)
        except OSError as exc:
            relay.check()  # a relay that exited: that, with its log
            raise PeerFailure(f"the relay check: {type(exc).__name__}: {exc}",
                              log_tail(str(log), 30)) from None
        finally:
            stop_processes([relay.popen.pid])
            relay.popen.wait()
    return {"round_trip_ms": round(relayed - direct, 3),
            "one_way_ms": round((relayed - direct) / 2, 3)}


def zctl_one_way_ms(delay_ms: float, messages: int = MESSAGES) -> float:
    """The one-way delay zctl's link layer adds to a frame on a loopback hop: a shaped
    PUSH's arrival times against a plain one's, medians."""
    import zmq

    from dataplane.wire.link import DelayedSender
    from dataplane.wire.transport import PipeOptions

    ctx = zmq.Context.instance()

    def one_way(options: PipeOptions | None) -> float:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        push: Any = DelayedSender(ctx, address, options) if options else ctx.socket(zmq.PUSH)
        if options is None:
            push.connect(address)
        times = []
        try:
            for _ in range(messages):
                start = time.perf_counter()
                (push.send_parts if options else push.send_multipart)([b"x" * 64])
                pull.recv_multipart()
                times.append((time.perf_counter() - start) * 1e3)
        finally:
            push.close(0)
            pull.close(0)
        return statistics.median(times)

    return one_way(PipeOptions(delay_ms=delay_ms)) - one_way(None)


def delay_check(delay_ms: float, logs: Path, host: str = "127.0.0.2") -> dict[str, Any]:
    """Both systems' added one-way delay per hop at ``delay_ms``, and whether they agree
    (within TOLERANCE_MS + 10%). A relay that fails is the check's failure (``error``,
    ``log_tail``: the relay's figures None, ``same`` false); the run goes on."""
    zctl = zctl_one_way_ms(delay_ms)
    try:
        relay = relay_one_way_ms(delay_ms, host, logs)
    except PeerFailure as exc:
        return {"delay_ms": delay_ms, "zctl_one_way_ms": round(zctl, 3),
                "relay_round_trip_ms": None, "relay_one_way_ms": None, "same": False,
                **exc.record()}
    same = abs(zctl - relay["one_way_ms"]) <= TOLERANCE_MS + 0.1 * delay_ms
    return {"delay_ms": delay_ms, "zctl_one_way_ms": round(zctl, 3),
            "relay_round_trip_ms": relay["round_trip_ms"],
            "relay_one_way_ms": relay["one_way_ms"], "same": same}
