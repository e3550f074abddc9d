"""A delaying TCP relay: what stands for a slow network hop in front of a llama.cpp RPC
server (there is no netem here). Each accepted connection is joined to the target, and
every chunk read from either side is written to the other ``delay_ms`` after it was
read, in order, so each direction gets that one-way latency and a round trip twice it,
as zctl's link layer gives each data-plane hop (dataplane.wire.link). Both sockets run
with TCP_NODELAY (llama.cpp's RPC sets it on its own).

    python -m tools.peers.relay LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS
"""

from __future__ import annotations

import asyncio
import socket
import sys
from contextlib import suppress

READ_BYTES = 1 << 16
READY = "relay ready"


def no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def delayed_pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay_s`` after it was read
    (in order); at the end of input the writer's side is shut for writing."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def take() -> None:
        try:
            while data := await reader.read(READ_BYTES):
                queue.put_nowait((loop.time() + delay_s, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((loop.time() + delay_s, b""))

    async def give() -> None:
        while True:
            due, data = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                with suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    taker = asyncio.create_task(take())
    try:
        await give()
    except (ConnectionError, OSError):
        pass
    finally:
        taker.cancel()
        with suppress(asyncio.CancelledError):
            await taker


class Relay:
    """A relay listening on ``listen`` (host, port; port 0: a free one) for ``target``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_ms: float) -> None:
        if delay_ms < 0:
            raise ValueError(f"a relay's delay must be >= 0 ms, got {delay_ms}")
        self.listen, self.target, self.delay_s = listen, target, delay_ms / 1e3
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        """Listen; the address it listens on."""
        self.server = await asyncio.start_server(self._join, *self.listen)
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def _join(self, client_reader: asyncio.StreamReader,
                    client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        no_delay(client_writer)
        no_delay(target_writer)
        try:
            await asyncio.gather(delayed_pump(client_reader, target_writer, self.delay_s),
                                 delayed_pump(target_reader, client_writer, self.delay_s))
        finally:
            for writer in (client_writer, target_writer):
                writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int], delay_ms: float) -> None:
    relay = Relay(listen, target, delay_ms)
    host, port = await relay.start()
    print(f"{READY} {host}:{port} -> {target[0]}:{target[1]} delay {delay_ms:g} ms", flush=True)
    await asyncio.Event().wait()  # until the process is stopped


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        listen, target, delay = parse_address(argv[0]), parse_address(argv[1]), float(argv[2])
        asyncio.run(serve(listen, target, delay))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
