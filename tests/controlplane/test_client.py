"""The control plane's client (controlplane.client): asking nobody, or a bad address, for a
status is a clear error within its timeout, not a hang."""

from __future__ import annotations

import time

import pytest
import zmq

from controlplane.client import ClusterUnreachable, query_status, query_status_timed
from zctl.launcher.local import free_port


def test_status_of_nothing_is_a_clear_error() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    ctx.term()
    with pytest.raises(ClusterUnreachable, match="no answer from a coordinator"):
        query_status(f"tcp://127.0.0.1:{port}", timeout=0.2)


def test_status_over_a_bad_address_or_to_nobody_is_a_bounded_error() -> None:
    with pytest.raises(ClusterUnreachable, match="not a coordinator address"):
        query_status("tcp://127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ClusterUnreachable, match="no answer"):
        query_status_timed(f"tcp://127.0.0.1:{free_port('127.0.0.1')}", timeout=0.3)
    assert time.monotonic() - start < 2.0
