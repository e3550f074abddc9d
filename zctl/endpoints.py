"""ZeroMQ TCP endpoints as zctl writes them (``tcp://HOST:PORT``, an IPv6 host in
brackets): the one place their host and port are read, and written back."""

from __future__ import annotations


def split_address(address: str) -> tuple[str, int]:
    """'tcp://10.0.0.5:5555' -> ('10.0.0.5', 5555) (a bracketed IPv6 host unbracketed);
    ValueError if it has no host or no port of ASCII digits."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not host:
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    return host.strip("[]"), int(port)


def tcp_address(host: str, port: int) -> str:
    """('::1', 5550) -> 'tcp://[::1]:5550': an IPv6 host in brackets (given bare or
    bracketed), any other as it is; ValueError without a host or with a port outside
    0..65535."""
    bare = host.strip("[]")
    if not bare or not 0 <= port <= 65535:
        raise ValueError(f"{host!r} port {port} is no tcp://HOST:PORT address")
    return f"tcp://[{bare}]:{port}" if ":" in bare else f"tcp://{bare}:{port}"
