"""A ZeroMQ TCP endpoint's host and port, read and written in one place."""

from __future__ import annotations

import pytest

from zctl.endpoints import split_address, split_bind_address, tcp_address


def test_an_endpoint_splits_into_host_and_port() -> None:
    assert split_address("tcp://10.0.0.5:5555") == ("10.0.0.5", 5555)
    assert split_address("tcp://[::1]:5550") == ("::1", 5550)
    assert split_address("pc-a.local:80") == ("pc-a.local", 80)


@pytest.mark.parametrize("bad", ["tcp://10.0.0.5", "tcp://:5555", "tcp://h:x", "tcp://h:",
                                 "tcp://h:５５"])
def test_an_endpoint_without_host_or_port_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        split_address(bad)


def test_an_address_is_written_with_an_ipv6_host_in_brackets() -> None:
    assert tcp_address("10.0.0.5", 5555) == "tcp://10.0.0.5:5555"
    assert tcp_address("::1", 5550) == tcp_address("[::1]", 5550) == "tcp://[::1]:5550"
    assert tcp_address("*", 5550) == "tcp://*:5550"
    for address in ("tcp://10.0.0.5:5555", "tcp://[::1]:5550", "tcp://[fe80::1%eth0]:7"):
        assert tcp_address(*split_address(address)) == address


@pytest.mark.parametrize("host, port", [("", 5550), ("[]", 5550), ("h", -1), ("h", 65536)])
def test_an_address_without_host_or_with_a_port_out_of_range_is_refused(host, port) -> None:
    with pytest.raises(ValueError, match="no tcp://HOST:PORT address"):
        tcp_address(host, port)


def test_an_address_to_bind_may_ask_for_any_free_port() -> None:
    assert split_bind_address("tcp://127.0.0.1:*") == ("127.0.0.1", None)
    assert split_bind_address("tcp://[::1]:*") == ("::1", None)
    assert split_bind_address("tcp://[::1]:5550") == ("::1", 5550)
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        split_address("tcp://127.0.0.1:*")  # an address to connect to names its port
    for bad in ("tcp://:*", "tcp://h:**", "tcp://h:"):
        with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
            split_bind_address(bad)
