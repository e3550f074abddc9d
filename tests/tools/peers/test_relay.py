"""The delaying relay on loopback, in front of a tiny echo server."""

from __future__ import annotations

import asyncio
import time

import pytest

from tools.peers.relay import Relay, parse_address


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def round_trips(port: int, messages: int) -> tuple[list[float], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times, received = [], b""
    for i in range(messages):
        start = time.perf_counter()
        writer.write(b"%03d" % i)
        await writer.drain()
        received += await reader.readexactly(3)
        times.append(time.perf_counter() - start)
    writer.write_eof()
    assert await reader.read() == b""  # the end of input passes through both ways
    writer.close()
    return times, received


async def through_relay(delay_ms: float, messages: int = 5) -> tuple[float, float, bytes]:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = Relay(("127.0.0.1", 0), ("127.0.0.1", port), delay_ms)
    _, relay_port = await relay.start()
    try:
        direct, _ = await round_trips(port, messages)
        relayed, data = await round_trips(relay_port, messages)
    finally:
        await relay.close()
        server.close()
    return min(direct), min(relayed), data


def test_a_round_trip_through_the_relay_takes_twice_its_delay_more() -> None:
    direct, relayed, data = asyncio.run(through_relay(30.0))
    assert data == b"".join(b"%03d" % i for i in range(5))  # in order, intact
    assert relayed - direct >= 2 * 0.030 * 0.95  # each direction delayed
    assert relayed - direct < 2 * 0.030 + 0.5  # and not much more (a busy 2-vCPU machine)


def test_without_delay_the_relay_passes_bytes_through() -> None:
    _, _, data = asyncio.run(through_relay(0.0, messages=3))
    assert data == b"000001002"


def test_bad_relay_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Relay(("127.0.0.1", 0), ("127.0.0.1", 1), -1.0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("127.0.0.1")
    assert parse_address("127.0.0.2:8080") == ("127.0.0.2", 8080)
