"""ZeroMQ TCP endpoints as zctl writes them (``tcp://HOST:PORT``, an IPv6 host in
brackets): the one place their host and port are read."""

from __future__ import annotations


def split_address(address: str) -> tuple[str, int]:
    """'tcp://10.0.0.5:5555' -> ('10.0.0.5', 5555) (a bracketed IPv6 host unbracketed);
    ValueError if it has no host or no port of ASCII digits."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not host:
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    return host.strip("[]"), int(port)
