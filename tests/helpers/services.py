"""Generation services for their clients' tests: one that goes away (what its clients
must notice at once), one that streams answers faster than they are read."""

from __future__ import annotations

import threading
import time

import zmq


def service_that_vanishes(ctx: zmq.Context) -> tuple[str, threading.Thread]:
    """A ROUTER that answers nothing and closes once a request arrives: its endpoint and
    the thread that closes it."""
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        router.recv_multipart()
        time.sleep(0.2)
        router.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


STREAM_CAP_S = 5.0  # how long service_that_streams streams at most


def service_that_streams(ctx: zmq.Context) -> tuple[str, threading.Thread, dict[str, bool]]:
    """A ROUTER that answers a generation with chunks as fast as it can send them, until
    a stats request comes (or STREAM_CAP_S passed), then answers that and ends the
    generation: its endpoint, its thread, and ``{"asked_while_streaming": ...}`` once the
    thread ends."""
    from controlplane.messages import from_frames, to_frames
    from zctl.engine.requests import GenerationChunk, GenerationDone
    from zctl.service.messages import ServiceStats, ServiceStatsRequest

    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    result: dict[str, bool] = {}

    def asks_stats(frames: list[bytes]) -> bool:
        return isinstance(from_frames(frames[1:])[0], ServiceStatsRequest)

    def serve() -> None:
        frames = router.recv_multipart()
        identity, request_id = frames[0], from_frames(frames[1:])[0].request_id
        chunk = to_frames(GenerationChunk(request_id, [1], "a", 1))
        asked, end = False, time.monotonic() + STREAM_CAP_S
        while not asked and time.monotonic() < end:
            router.send_multipart([identity, *chunk])  # (dropped when the client lags)
            asked = bool(router.poll(0)) and asks_stats(router.recv_multipart())
        result["asked_while_streaming"] = asked
        while not asked:
            asked = asks_stats(router.recv_multipart())
        router.send_multipart([identity, *to_frames(ServiceStats(0, 0, {}, [], [], {}))])
        router.send_multipart([identity, *to_frames(
            GenerationDone(request_id, [1], "a", 1, 0.0, 0.0))])
        time.sleep(1.0)  # (closed at once, the client would see it go before the end)
        router.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread, result
