"""A generation service that goes away: what its clients must notice at once."""

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
