"""The control plane's client (controlplane.client): asking nobody for a status is a clear
error, not a hang."""

from __future__ import annotations

import pytest
import zmq

from controlplane.client import ClusterUnreachable, query_status


def test_status_of_nothing_is_a_clear_error() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    ctx.term()
    with pytest.raises(ClusterUnreachable, match="no answer from a coordinator"):
        query_status(f"tcp://127.0.0.1:{port}", timeout=0.2)
