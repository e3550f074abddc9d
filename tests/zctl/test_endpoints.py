"""A ZeroMQ TCP endpoint's host and port, read in one place."""

from __future__ import annotations

import pytest

from zctl.endpoints import split_address


def test_an_endpoint_splits_into_host_and_port() -> None:
    assert split_address("tcp://10.0.0.5:5555") == ("10.0.0.5", 5555)
    assert split_address("tcp://[::1]:5550") == ("::1", 5550)
    assert split_address("pc-a.local:80") == ("pc-a.local", 80)


@pytest.mark.parametrize("bad", ["tcp://10.0.0.5", "tcp://:5555", "tcp://h:x", "tcp://h:",
                                 "tcp://h:５５"])
def test_an_endpoint_without_host_or_port_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a tcp://HOST:PORT address"):
        split_address(bad)
