"""The per-hop delay check: a relay that fails to start, or breaks the connection, is the
check's failure with the relay's log, and the run goes on."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from tools.peers import links


@pytest.mark.e2e  # starts the relay: python -m tools.peers.relay
def test_a_relay_that_cannot_start_is_the_checks_failure_with_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the relay's port, already in use
        monkeypatch.setattr(links, "free_port", lambda host: taken.getsockname()[1])
        monkeypatch.setattr(links, "zctl_one_way_ms", lambda delay_ms: 5.1)
        check = links.delay_check(5.0, tmp_path, host="127.0.0.1")
    assert check["error"] == "the relay check exited with 1"
    assert "address already in use" in check["log_tail"]
    assert check["zctl_one_way_ms"] == 5.1 and check["relay_one_way_ms"] is None
    assert check["same"] is False


def test_a_round_trip_to_a_server_that_closes_the_connection_is_an_error() -> None:
    """(It ended no loop before: a closed connection reads nothing, forever.)"""
    listener = socket.create_server(("127.0.0.1", 0))

    def read_one_message_then_close() -> None:
        conn, _ = listener.accept()
        with conn:
            got = b""
            while len(got) < 64:
                got += conn.recv(64)

    server = threading.Thread(target=read_one_message_then_close, daemon=True)
    server.start()
    outcome: list[BaseException | float] = []

    def measure() -> None:
        try:
            outcome.append(links.round_trip_ms("127.0.0.1", listener.getsockname()[1], 3))
        except OSError as exc:
            outcome.append(exc)

    client = threading.Thread(target=measure, daemon=True)
    client.start()
    client.join(5.0)
    listener.close()
    assert outcome and isinstance(outcome[0], ConnectionError), outcome
    assert "closed the connection" in str(outcome[0])
