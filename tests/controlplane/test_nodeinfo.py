"""A node's data-plane port (controlplane.nodeinfo): the configured one, else the last one,
else a fresh one below the kernel's ephemeral range, where an outgoing connection cannot
take it between the node's start and the stage's bind; the host of the coordinator's
endpoint, IPv6 literals included."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from controlplane.nodeinfo import (
    LOWEST_DATA_PORT,
    choose_data_port,
    endpoint_host,
    ephemeral_ports,
    fresh_port,
    ram,
)


def _listening_on(port: int) -> socket.socket:
    """A listener on a port ``fresh_port`` chose, bound as ZeroMQ binds (SO_REUSEADDR), so
    that a TIME_WAIT left on the port by an earlier test does not refuse it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_the_ephemeral_range_is_read_or_linux_default(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("20000\t50000\n")
    assert ephemeral_ports(tmp_path / "range") == (20000, 50000)
    (tmp_path / "bad").write_text("lots")
    assert ephemeral_ports(tmp_path / "bad") == ephemeral_ports(tmp_path / "none") == (32768, 60999)


def test_a_fresh_port_is_below_the_ephemeral_range_and_free() -> None:
    """Free as a stage binds it: ZeroMQ sets SO_REUSEADDR on a listening socket, so a port
    another test's closed connection left in TIME_WAIT is free to it (a bare bind refuses
    that port, which made this test fail when the suite had used it just before)."""
    for _ in range(20):
        port = fresh_port("127.0.0.1", (32768, 60999))
        assert LOWEST_DATA_PORT <= port < 32768
        _listening_on(port).close()
    # no room below the range: any free port
    assert 0 < fresh_port("127.0.0.1", (LOWEST_DATA_PORT, 60999)) < 65536


def test_the_configured_then_the_last_then_a_fresh_port(tmp_path: Path) -> None:
    assert choose_data_port("127.0.0.1", tmp_path, 5555) == 5555
    first = choose_data_port("127.0.0.1", tmp_path)
    assert LOWEST_DATA_PORT <= first < ephemeral_ports()[0]
    assert choose_data_port("127.0.0.1", tmp_path) == first  # kept across restarts
    with _listening_on(first):  # taken by someone else: a fresh one, remembered
        second = choose_data_port("127.0.0.1", tmp_path)
    assert second != first and (tmp_path / "data_port").read_text().strip() == str(second)


def test_a_stage_pipe_waits_for_its_address_to_be_free_again() -> None:
    """A stage relaunched on its address (a re-wiring) binds while the last one's port is
    still being released: its pipe waits for it, briefly, instead of failing the stage."""
    import threading
    import time

    import pytest
    import zmq

    from dataplane.wire.transport import PipeOptions, TransportError, pull_socket

    port = fresh_port("127.0.0.1", (32768, 60999))
    holder = _listening_on(port)
    threading.Timer(0.3, holder.close).start()  # released a moment later
    ctx = zmq.Context.instance()
    start = time.monotonic()
    sock = pull_socket(ctx, f"tcp://127.0.0.1:{port}", PipeOptions())
    assert 0.2 < time.monotonic() - start < 2.0
    sock.close(0)
    other = fresh_port("127.0.0.1", (32768, 60999))
    with _listening_on(other):  # never released: the same clear error as before
        with pytest.raises(TransportError, match="Address already in use"):
            pull_socket(ctx, f"tcp://127.0.0.1:{other}", PipeOptions())


def test_the_ram_a_node_lends_is_capped_by_its_limit() -> None:
    total, free = ram()
    assert 0 < free <= total
    assert ram(1 << 20) == (1 << 20, min(free, 1 << 20))
    assert ram(0)[0] == total and ram(1 << 60)[0] == total  # 0, or more than there is: no cap


def test_the_coordinator_s_host_is_read_from_its_endpoint() -> None:
    assert endpoint_host("tcp://10.0.0.5:5555") == "10.0.0.5"
    assert endpoint_host("tcp://[::1]:5555") == "::1"
    assert endpoint_host("tcp://[fe80::1%eth0]:5550") == "fe80::1%eth0"
    assert endpoint_host("tcp://pc-a.local:5550") == "pc-a.local"
    assert endpoint_host("tcp://127.0.0.1:*") == "127.0.0.1"  # a coordinator's bind, any port
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        endpoint_host("tcp://[::1]")  # no port: not taken for host "[:" and port 1
