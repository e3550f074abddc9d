"""ZeroMQ TCP endpoints as zctl writes them (``tcp://HOST:PORT``, an IPv6 host in
brackets): the one place their host and port are read, and written back."""

from __future__ import annotations

ANY_PORT = "*"  # ZeroMQ's wildcard port in an address to bind: any free port


def _host_and_port(address: str) -> tuple[str, str]:
    """The host (unbracketed) and the port's text of ``address``; ValueError when either
    is missing."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port or not host.strip("[]"):
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    return host.strip("[]"), port


def split_address(address: str) -> tuple[str, int]:
    """'tcp://10.0.0.5:5555' -> ('10.0.0.5', 5555) (a bracketed IPv6 host unbracketed);
    ValueError if it has no host or no port of ASCII digits."""
    host, port = _host_and_port(address)
    if not port.isascii() or not port.isdigit():
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    return host, int(port)


def split_bind_address(address: str) -> tuple[str, int | None]:
    """``split_address`` for an address to bind, whose port may also be ZeroMQ's wildcard
    (``tcp://127.0.0.1:*`` -> ('127.0.0.1', None): any free port)."""
    host, port = _host_and_port(address)
    return (host, None) if port == ANY_PORT else split_address(address)


def tcp_address(host: str, port: int) -> str:
    """('::1', 5550) -> 'tcp://[::1]:5550': an IPv6 host in brackets (given bare or
    bracketed), any other as it is; ValueError without a host or with a port outside
    0..65535."""
    bare = host.strip("[]")
    if not bare or not 0 <= port <= 65535:
        raise ValueError(f"{host!r} port {port} is no tcp://HOST:PORT address")
    return f"tcp://[{bare}]:{port}" if ":" in bare else f"tcp://{bare}:{port}"
